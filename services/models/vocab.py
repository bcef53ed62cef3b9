"""Cut a pre-trained vocabulary down to the token ids a corpus uses.

The XLM-R embedding table is 250k x 384 (370 MiB fp32) and a translation corpus touches a few
percent of it; the target side's output head scores every kept id at every masked position, so
a smaller target vocabulary is also less compute. A ``VocabMap`` translates between the
tokenizer's ids ("old") and the model's ids ("new"); special tokens are always kept, first.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from nebula.errors import DataError
from services.models.plm import BertModel, Pretrained, SpecialIds


@dataclass
class VocabMap:
    new_to_old: torch.Tensor  # (V_new,) long
    old_size: int
    unk_old: int

    def __post_init__(self):
        self.old_to_new = torch.full((self.old_size,), -1, dtype=torch.long)
        self.old_to_new[self.new_to_old] = torch.arange(len(self.new_to_old))
        if self.old_to_new[self.unk_old] < 0:
            raise DataError("the vocabulary map must keep the unknown token")

    def __len__(self) -> int:
        return len(self.new_to_old)

    def to_new(self, old_ids: torch.Tensor) -> torch.Tensor:
        """Tokenizer ids -> model ids; ids the corpus never showed become <unk>."""
        new = self.old_to_new[old_ids]
        return torch.where(new < 0, self.old_to_new[self.unk_old], new)

    def to_old(self, new_ids: torch.Tensor) -> torch.Tensor:
        return self.new_to_old[new_ids]

    def specials(self, old: SpecialIds) -> SpecialIds:
        """The special ids in the model's id space."""
        m = {f: int(self.old_to_new[getattr(old, f)]) for f in ("pad", "bos", "eos", "unk", "mask")}
        return SpecialIds(**m)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"old_size": self.old_size, "unk_old": self.unk_old,
                                          "new_to_old": self.new_to_old.tolist()}))

    @classmethod
    def load(cls, path: Path) -> VocabMap:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(torch.tensor(raw["new_to_old"], dtype=torch.long),
                       raw["old_size"], raw["unk_old"])
        except (OSError, KeyError, ValueError) as exc:
            raise DataError(f"cannot read vocabulary map {path}: {exc}; rebuild it "
                            f"with build_vocab_map") from exc


def count_ids(rows: Iterable[Iterable[int]]) -> Counter:
    """Token-id counts over tokenized sentences."""
    counts: Counter = Counter()
    for row in rows:
        counts.update(row)
    return counts


def build_vocab_map(counts: Counter, specials: SpecialIds, old_size: int,
                    min_count: int = 1, max_size: int | None = None) -> VocabMap:
    """Keep the specials, then ids seen ``min_count`` times, most frequent first."""
    keep = list(dict.fromkeys(specials.as_list()))
    seen = [i for i, c in counts.most_common() if c >= min_count and i not in set(keep)]
    bad = [i for i in seen if not 0 <= i < old_size]
    if bad:
        raise DataError(f"token ids {bad[:5]} are outside the vocabulary of {old_size}; "
                        f"were these counts made with another tokenizer?")
    if max_size is not None:
        seen = seen[:max(0, max_size - len(keep))]
    new_to_old = torch.tensor(keep + sorted(seen), dtype=torch.long)
    return VocabMap(new_to_old, old_size, specials.unk)


def cut_embeddings(model: BertModel, vmap: VocabMap) -> BertModel:
    """Replace the word-embedding table by the rows of the kept ids, in place."""
    old = model.embeddings.word_embeddings
    if old.num_embeddings != vmap.old_size:
        raise DataError(f"vocabulary map is for {vmap.old_size} ids but the model has "
                        f"{old.num_embeddings}; build the map from this model's tokenizer")
    new = nn.Embedding(len(vmap), old.embedding_dim)
    new.weight.data.copy_(old.weight.data[vmap.new_to_old])  # (V_new, H)
    new.weight.requires_grad_(old.weight.requires_grad)
    model.embeddings.word_embeddings = new
    model.cfg = model.embeddings.cfg = replace(model.cfg, vocab_size=len(vmap))
    return model


def encode_texts(pre: Pretrained, vmap: VocabMap | None, texts: list[str],
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> model ids (B, S) and padding mask (B, S), through the map when there is one."""
    ids, mask = pre.encode(texts, max_len)
    return (ids if vmap is None else vmap.to_new(ids)), mask
