"""What ELECTRA-Cloud trains on: token sequences packed from the offline corpora, one shared vocabulary.

Every model of the workload (each generator, the discriminator) uses the XLM-R tokenizer cut to the
token ids of the corpora's training text, so the ids a generator sends need no translation. The cut
vocabulary is ordered by frequency (specials first): frequent tokens get small ids, whose high bytes are
zero, which is what lets the lossless `deflate` codec bring an index-only link under 2 bytes per token.
The vocabulary is a list of token ids, not text: in a real deployment one site builds it and ships the
file with the job (`vocab_file`), so data never leaves its site.

Sequences, as ELECTRA pre-trains on (packed text, not one short sentence per row):
- MRTD: consecutive sentences of one language and one package, `<s> a </s> b </s> ...` up to max_len;
- TRTD: consecutive parallel pairs of one package, the source chunk then its translation,
  `<s> es_1 es_2 </s> en_1 en_2 </s>`, up to max_len (XLM-E's translation pairs).
A sequence's example id is `task:side:id-of-its-first-sentence`, unique and the same at every run.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from nebula.errors import DataError
from services.corpus.corpus import ParallelSide
from services.models.plm import SpecialIds, pad_rows
from services.models.vocab import VocabMap
from services.models.xlmr_e5 import load_xlmr_tokenizer

SPLITS = ("train", "valid", "test")
TASKS = ("mrtd", "trtd")
SIDES = {"src": 0, "tgt": 1}


def tokenizer():
    return load_xlmr_tokenizer()


def specials_of(tok) -> SpecialIds:
    ids = {name: tok.token_to_id(token) for name, token in
           (("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>"), ("mask", "<mask>"))}
    return SpecialIds(**ids)


def corpus_dir(root: Path, corpus: str) -> Path:
    path = Path(root) / corpus
    if not (path / "train.src").is_file():
        raise DataError(f"corpus {corpus!r} not found in {root} (no {path / 'train.src'}): run "
                        f"`nebula data prepare` or point [job].data at the directory that holds {corpus}/")
    return path


def encode(tok, lines: list[str]) -> list[list[int]]:
    """Token ids of each line without the specials the tokenizer adds (<s> ... </s>)."""
    return [enc.ids[1:-1] for enc in tok.encode_batch(lines)]


# -- the shared vocabulary ---------------------------------------------------------------------------------
def build_vocab(root: Path, corpora: Iterable[str], tok) -> VocabMap:
    """Specials first, then every token id of the corpora's training text, most frequent first."""
    counts: Counter = Counter()
    for corpus in corpora:
        for side in SIDES:
            for row in encode(tok, ParallelSide(corpus_dir(root, corpus) / "train", side).lines):
                counts.update(row)
    specials = specials_of(tok)
    keep = list(dict.fromkeys(specials.as_list()))
    ranked = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if i not in set(keep)]
    return VocabMap(torch.tensor(keep + ranked, dtype=torch.long), tok.get_vocab_size(), specials.unk)


def load_vocab(root: Path, corpora: tuple[str, ...], vocab_file: str | None, tok) -> VocabMap:
    """The job's vocabulary file if it names one, else the one built from `corpora` (cached beside them;
    written atomically: the stages of a local job build it at the same time)."""
    if vocab_file:
        return VocabMap.load(Path(vocab_file))
    digest = hashlib.sha256(json.dumps(sorted(corpora)).encode()).hexdigest()[:12]
    path = Path(root) / f"electra-vocab-{'+'.join(sorted(corpora))}-{digest}.json"
    if path.is_file():
        return VocabMap.load(path)
    vmap = build_vocab(root, sorted(corpora), tok)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    vmap.save(tmp)
    os.replace(tmp, path)
    return vmap


def to_model_ids(vmap: VocabMap, rows: list[list[int]]) -> list[list[int]]:
    """Tokenizer ids -> model ids; an id the vocabulary lacks becomes <unk>."""
    table, unk = vmap.old_to_new.tolist(), int(vmap.old_to_new[vmap.unk_old])
    return [[table[i] if table[i] >= 0 else unk for i in row] for row in rows]


# -- packed sequences -------------------------------------------------------------------------------------
@dataclass
class Sequences:
    """One split's training sequences: model ids (variable length) and their example ids."""

    rows: list[list[int]]
    ids: list[str]

    def batch(self, indices: list[int], pad: int) -> torch.Tensor:
        """(B, S) long, right-padded with `pad`."""
        return pad_rows([self.rows[i] for i in indices], pad)


def package(example_id: str) -> str:
    return example_id.split(":", 1)[0]


def pack_mono(rows: list[list[int]], ids: list[str], max_len: int, bos: int, eos: int,
              tag: str) -> Sequences:
    """MRTD: consecutive sentences of one package, each closed by </s>, up to max_len tokens."""
    out = Sequences([], [])
    current: list[int] = []
    first, last_package = "", None
    for row, eid in zip(rows, ids):
        row = row[:max_len - 2]
        if current and (len(current) + len(row) + 1 > max_len or package(eid) != last_package):
            out.rows.append(current)
            out.ids.append(f"{tag}:{first}")
            current = []
        if not current:
            current, first = [bos], eid
        current += row + [eos]
        last_package = package(eid)
    if current:
        out.rows.append(current)
        out.ids.append(f"{tag}:{first}")
    return out


def pack_pairs(src: list[list[int]], tgt: list[list[int]], ids: list[str], max_len: int, bos: int, eos: int,
               tag: str) -> Sequences:
    """TRTD: consecutive pairs of one package, `<s> src... </s> tgt... </s>`, up to max_len tokens."""
    out = Sequences([], [])
    a: list[int] = []
    b: list[int] = []
    first, last_package = "", None
    half = max_len // 2 - 2
    for s, t, eid in zip(src, tgt, ids):
        s, t = s[:half], t[:half]
        if (a or b) and (len(a) + len(b) + len(s) + len(t) + 3 > max_len or package(eid) != last_package):
            out.rows.append([bos, *a, eos, *b, eos])
            out.ids.append(f"{tag}:{first}")
            a, b = [], []
        if not a and not b:
            first = eid
        a, b = a + s, b + t
        last_package = package(eid)
    if a or b:
        out.rows.append([bos, *a, eos, *b, eos])
        out.ids.append(f"{tag}:{first}")
    return out


class GeneratorCorpus:
    """A generator's text: one parallel corpus (its language group with English), every split packed
    into MRTD sequences of both sides and TRTD sequences of the pairs, in model ids."""

    def __init__(self, root: Path, corpus: str, tasks: tuple[str, ...], max_len: int, vmap: VocabMap, tok,
                 limit: int | None = None):
        specials = vmap.specials(specials_of(tok))
        self.splits: dict[str, Sequences] = {}
        for split in SPLITS:
            sides = {side: ParallelSide(corpus_dir(root, corpus) / split, side) for side in SIDES}
            rows = {side: to_model_ids(vmap, encode(tok, part.lines)) for side, part in sides.items()}
            ids = sides["src"].ids
            parts = []
            if "mrtd" in tasks:
                parts += [pack_mono(rows[side], ids, max_len, specials.bos, specials.eos, f"mrtd:{corpus}:{side}")
                          for side in SIDES]
            if "trtd" in tasks:
                parts.append(pack_pairs(rows["src"], rows["tgt"], ids, max_len, specials.bos, specials.eos,
                                        f"trtd:{corpus}"))
            merged = Sequences([r for p in parts for r in p.rows], [i for p in parts for i in p.ids])
            if limit is not None and split == "train":
                # a spread over the whole list, not its head: every task keeps its share
                keep = [k * len(merged.rows) // limit for k in range(min(limit, len(merged.rows)))]
                merged = Sequences([merged.rows[k] for k in keep], [merged.ids[k] for k in keep])
            self.splits[split] = merged
