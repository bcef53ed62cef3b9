"""What each half of ABNet-Cloud reads: only its own side of the parallel data, tokenized, its
vocabulary cut to the ids it uses; and the optimiser both halves train with."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nebula.errors import DataError
from nebula.runtime.order import id_hash
from services.corpus.corpus import ParallelSide
from services.models.plm import Pretrained, pad_rows
from services.models.vocab import build_vocab_map, count_ids

SPLITS = ("train", "valid", "test")


def adam_with_warmup(params: list, lr: float, warmup_steps: int, schedule: str = "inverse-sqrt",
                     total_steps: int = 0) -> tuple[torch.optim.Optimizer, Any]:
    """Adam(0.9, 0.98, 1e-8) as the paper; a linear warm-up, then the learning rate decays as
    `schedule`: "inverse-sqrt" (the paper's, open-ended) or "linear" (to zero at `total_steps`, for a
    run of known length: docs/abnet.md, "A demo that translates")."""
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(warmup_steps, schedule, total_steps))
    return opt, sched


def lr_factor(warmup_steps: int, schedule: str, total_steps: int):
    """-> step (0-based) -> the factor of the peak learning rate."""
    warm = max(1, warmup_steps)
    if schedule == "inverse-sqrt":
        return lambda s: min((s + 1) / warm, math.sqrt(warm / (s + 1)))
    if schedule == "linear":
        if total_steps <= warm:
            raise ValueError(f"lr_schedule 'linear' needs more steps ({total_steps}) than warmup_steps ({warm})")
        return lambda s: min((s + 1) / warm, max(0.0, (total_steps - s) / (total_steps - warm)))
    raise ValueError(f"unknown lr_schedule {schedule!r}: 'inverse-sqrt' or 'linear'")


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
        lengths = [len(r) for r in rows]  # before truncation
        rows = [r[:max_len - 1] + [pre.specials.eos] if len(r) > max_len else r for r in rows]
        hashes = [id_hash(i) for i in ids]
        self.splits[split] = {"ids": ids, "rows": rows, "hashes": hashes, "lengths": lengths,
                              "index": {h: k for k, h in enumerate(hashes)}, "text": lines}

    def keep(self, split: str, kept: list[bool]) -> None:
        """Only the sentences of `split` whose entry in `kept` is true (the vocabulary stays as it is)."""
        part = self.splits[split]
        chosen = [k for k, keep in enumerate(kept) if keep]
        if not chosen:
            raise DataError(f"no sentence of the {split} split is left to train on")
        for key in ("ids", "rows", "hashes", "lengths", "text"):
            part[key] = [part[key][k] for k in chosen]
        part["index"] = {h: k for k, h in enumerate(part["hashes"])}

    def batch(self, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (token ids (B, S) in the cut vocabulary, mask (B, S), id hashes (B,))."""
        part = self.splits[split]
        ids = pad_rows([part["rows"][i] for i in indices], self.pad)
        mask = ids != self.pad
        return self.vmap.to_new(ids), mask, torch.tensor([part["hashes"][i] for i in indices])

    def lookup(self, split: str, hashes: torch.Tensor) -> list[int]:
        if split not in self.splits:  # a split the other site asked for by name (an inference pass)
            raise DataError(f"the other site sent examples of a {split!r} split; this site's data has "
                            f"{', '.join(sorted(self.splits))}: both sites must use the same prepared data")
        index = self.splits[split]["index"]
        missing = [h for h in hashes.tolist() if h not in index]
        if missing:
            raise DataError(f"{len(missing)} example ids received from the other site are not in this "
                            f"site's {split} split: both sites must use the same prepared data")
        return [index[h] for h in hashes.tolist()]
