"""The two halves of ABNet-Cloud as the split runner sees them: each reads only its own side of the
data, tokenizes it, cuts its vocabulary to the ids it uses and owns its optimizer."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nebula.data.corpus import ParallelSide
from nebula.errors import DataError
from nebula.runtime.job import TrainConfig
from nebula.runtime.schedule import id_hash
from services.abnet.baseline import BaselineConfig, BaselineDecoder, BaselineEncoder
from services.abnet.model import AbnetConfig, build_source_encoder, build_target_decoder
from services.abnet.plm import Pretrained
from services.abnet.vocab import build_vocab_map, count_ids

SPLITS = ("train", "valid", "test")


def adam_with_warmup(params: list, train: TrainConfig) -> tuple[torch.optim.Optimizer, Any]:
    """Adam(0.9, 0.98, 1e-8) as the paper; linear warm-up then inverse square-root decay."""
    opt = torch.optim.Adam(params, lr=train.lr, betas=(0.9, 0.98), eps=1e-8)
    warm = max(1, train.warmup_steps)
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
        rows = [part["rows"][i] for i in indices]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, :len(row)] = torch.tensor(row)
        mask = ids != self.pad
        return self.vmap.to_new(ids), mask, torch.tensor([part["hashes"][i] for i in indices])

    def lookup(self, split: str, hashes: torch.Tensor) -> list[int]:
        index = self.splits[split]["index"]
        missing = [h for h in hashes.tolist() if h not in index]
        if missing:
            raise DataError(f"{len(missing)} example ids received from the other site are not in this "
                            f"site's {split} split: both sites must use the same prepared data")
        return [index[h] for h in hashes.tolist()]


class _Trainable:
    """Optimizer plumbing shared by both sides (the SplitModel protocol)."""

    module: torch.nn.Module

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {k: p for k, p in self.module.named_parameters() if p.requires_grad}

    def optimizer_step(self, step: int) -> None:
        self.opt.step()
        self.sched.step()

    def state_dict(self) -> dict[str, Any]:
        weights = {k: v for k, v in self.module.state_dict().items() if k in self.trainable()}
        return {"adapters": weights, "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["adapters"], strict=False)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])


class EncoderSide(_Trainable):
    """Site a: source text only."""

    def __init__(self, pre: Pretrained, data_dir: str, train: TrainConfig, cfg: AbnetConfig,
                 limit: int | None = None, baseline: BaselineConfig | None = None):
        self.pre, self.max_len = pre, train.max_len
        self.data = TokenizedSide(data_dir, "src", pre, train.max_len, limit)
        if baseline:  # from scratch, same tokenizer and cut vocabulary (paper Table 2's Transformer)
            pad = self.data.vmap.specials(pre.specials).pad
            self.module = BaselineEncoder(len(self.data.vmap), pad, baseline)
        else:
            self.module = build_source_encoder(pre, cfg, self.data.vmap)
        self.opt, self.sched = adam_with_warmup(self.module.trainable_parameters(), train)
        self.n_train = len(self.data.splits["train"]["rows"])

    def add_input(self, split: str, lines: list[str]) -> None:
        """Sentences to translate (not from the corpus): tokenized with the same vocabulary."""
        self.data.add_split(split, lines, [f"{split}:{i}" for i in range(len(lines))], self.pre, self.max_len)

    def forward(self, indices: list[int], split: str = "train",
                weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        self.module.train(split == "train")
        ids, mask, hashes = self.data.batch(split, indices)
        if weights is None:
            hidden = self.module(ids, mask)  # (B, S, H)
        else:  # a stashed copy of the adapters (staleness 1, nebula.runtime.head)
            hidden = torch.func.functional_call(self.module, weights, (ids, mask))
        return {"hidden": hidden, "mask": mask, "ids": hashes}


class DecoderSide(_Trainable):
    """Site b: target text only; looks its targets up by the example-id hashes it receives."""

    def __init__(self, pre: Pretrained, data_dir: str, train: TrainConfig, cfg: AbnetConfig,
                 enc_hidden: int, limit: int | None = None, decode_iterations: int = 10, beam: int = 4,
                 baseline: BaselineConfig | None = None):
        self.pre, self.decode_iterations, self.beam = pre, decode_iterations, beam
        self.enc_hidden = enc_hidden  # H of the boundary the encoder sends; checked on every message
        self.data = TokenizedSide(data_dir, "tgt", pre, train.max_len, limit)
        if baseline:
            self.module = BaselineDecoder(len(self.data.vmap), self.data.vmap.specials(pre.specials), baseline)
        else:
            self.module = build_target_decoder(pre, cfg, enc_hidden, self.data.vmap)
        self.opt, self.sched = adam_with_warmup(self.module.trainable_parameters(), train)

    def check_boundary(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden (B, S, H) float, source mask (B, S) bool), or a DataError saying what differs."""
        if "mask" not in inputs:
            raise DataError(f"the encoder sent no 'mask' tensor (got {', '.join(sorted(inputs))}): "
                            "run the abnet-encoder stage at the other site")
        hidden, src_mask = inputs["hidden"], inputs["mask"].bool()
        if not hidden.is_floating_point():
            raise DataError(f"received hidden of dtype {hidden.dtype}: the encoder must send floating point")
        if hidden.dim() != 3 or hidden.shape[:2] != src_mask.shape:
            raise DataError(f"received hidden {tuple(hidden.shape)} and mask {tuple(src_mask.shape)} do not "
                            "match: expected (B, S, H) and (B, S)")
        if hidden.shape[-1] != self.enc_hidden:
            raise DataError(f"the encoder sends hidden size {hidden.shape[-1]} but this decoder expects "
                            f"{self.enc_hidden}: set [stages.decoder].enc_hidden = {hidden.shape[-1]} in the job "
                            "file (the encoder PLM's hidden size)")
        return hidden.float(), src_mask

    def loss(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.module.train()
        hidden, src_mask = self.check_boundary(inputs)
        tgt_ids, tgt_mask, _ = self.data.batch("train", self.data.lookup("train", inputs["ids"]))
        return self.module.loss(hidden, src_mask, tgt_ids, tgt_mask).loss

    @torch.no_grad()
    def translate(self, inputs: dict[str, torch.Tensor]) -> list[str]:
        """Beam search (ar) or mask-predict with a length beam (cmlm), beam 4 as the paper's ->
        detokenized sentences."""
        from services.abnet.decoding import detokenize
        self.module.eval()
        hidden, src_mask = self.check_boundary(inputs)
        rows = self.module.decode(hidden, src_mask, iterations=self.decode_iterations, beam=self.beam)
        return [detokenize(r, self.pre.tokenizer, self.data.vmap) for r in rows]

    def references(self, split: str, hashes: torch.Tensor) -> list[str]:
        return [self.data.splits[split]["text"][i] for i in self.data.lookup(split, hashes)]
