"""What each half of ABNet-Cloud reads: only its own side of the parallel data, tokenized, its
vocabulary cut to the ids it uses; and the optimiser both halves train with."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from services.corpus.corpus import ParallelSide
from nebula.errors import DataError
from nebula.runtime.order import id_hash
from services.abnet.plm import Pretrained, pad_rows
from services.abnet.vocab import build_vocab_map, count_ids

SPLITS = ("train", "valid", "test")


def adam_with_warmup(params: list, lr: float, warmup_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """Adam(0.9, 0.98, 1e-8) as the paper; linear warm-up then inverse square-root decay."""
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    warm = max(1, warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, math.sqrt(warm / (s + 1))))
    return opt, sched


class TokenizedSide:
    """One side of every split: id strings, their hashes, and token rows (model ids, truncated)."""

    def __init__(self, data_dir: str, side: str, pre: Pretrained, max_len: int, limit: int | None):
        self.splits: dict[str, dict[str, Any]] = {}
        for split in SPLITS:
            prefix = Path(data_dir) / split
            if not prefix.with_name(f"{split}.{side}").exists():
                raise DataError(f"{prefix}.{side} not found: run `nebula data prepare` or point [job].data "
                                "at a directory with train/valid/test .src/.tgt/.ids files")
            part = ParallelSide(prefix, side)
            n = len(part) if limit is None or split != "train" else min(limit, len(part))
            self.add_split(split, part.lines[:n], part.ids[:n], pre, max_len)
        self.vmap = build_vocab_map(count_ids(r for s in self.splits.values() for r in s["rows"]),
                                    pre.specials, pre.model.embeddings.word_embeddings.num_embeddings)
        self.pad = pre.specials.pad

    def add_split(self, split: str, lines: list[str], ids: list[str], pre: Pretrained, max_len: int) -> None:
        """Tokenize `lines` (truncated to max_len with a closing special) under the name `split`."""
        rows = [enc.ids for enc in pre.tokenizer.encode_batch(lines)]
        rows = [r[:max_len - 1] + [pre.specials.eos] if len(r) > max_len else r for r in rows]
        hashes = [id_hash(i) for i in ids]
        self.splits[split] = {"ids": ids, "rows": rows, "hashes": hashes,
                              "index": {h: k for k, h in enumerate(hashes)}, "text": lines}

    def batch(self, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (token ids (B, S) in the cut vocabulary, mask (B, S), id hashes (B,))."""
        part = self.splits[split]
        ids = pad_rows([part["rows"][i] for i in indices], self.pad)
        mask = ids != self.pad
        return self.vmap.to_new(ids), mask, torch.tensor([part["hashes"][i] for i in indices])

    def lookup(self, split: str, hashes: torch.Tensor) -> list[int]:
        index = self.splits[split]["index"]
        missing = [h for h in hashes.tolist() if h not in index]
        if missing:
            raise DataError(f"{len(missing)} example ids received from the other site are not in this "
                            f"site's {split} split: both sites must use the same prepared data")
        return [index[h] for h in hashes.tolist()]
