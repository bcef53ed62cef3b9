"""ABNet-Cloud stage modules: the encoder at the source site, the decoder at the target site.

The encoder reads the source side of the parallel data and sends H_E ("hidden", (B, S, H)) and its
mask; the decoder reads the target side, looks each example's target up by its id, computes the
loss and returns dL/dH_E (the link is two-way). After training the encoder asks for a test-set
evaluation; the decoder decodes and scores BLEU against the references only it holds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import torch
from sacrebleu.metrics import BLEU

from nebula.config import limits
from nebula.errors import ConfigError, DataError, StageError
from nebula.runtime.stage import FLOAT, Batch, Output, Port, Stage
from services.abnet.baseline import BaselineConfig, BaselineDecoder, BaselineEncoder
from services.abnet.decoding import detokenize
from services.abnet.model import AbnetConfig, build_source_encoder, build_target_decoder
from services.abnet.sides import TokenizedSide, adam_with_warmup
from services.models.minilm import load_minilm
from services.models.xlmr_e5 import load_e5_small

INPUT_SPLIT = "input"
BOOTSTRAP = 1000  # resamples for BLEU's interval  # sentences given to `nebula translate`: translated, not scored
BOUNDARY = (Port("hidden", FLOAT, rank=3, role="activation"),  # H_E (B, S, H)
            Port("mask", "bool", rank=2, role="mask"))  # source positions (B, S)


@dataclass(frozen=True, kw_only=True)
class _Options:
    model: Literal["abnet", "transformer"] = "abnet"  # transformer: from scratch, paper Table 2's baseline
    lr: float = field(default=5e-4, metadata=limits(above=0, below=1))
    warmup_steps: int = field(default=50, metadata=limits(at_least=0))
    lr_schedule: Literal["inverse-sqrt", "linear"] = "inverse-sqrt"  # linear: to zero at the last step
    # adapters after the top `adapter_layers` PLM layers only (None: every layer, the paper's); the
    # frozen layers below the first adapter build no autograd graph (docs/abnet.md, "A demo that translates")
    adapter_layers: int | None = field(default=None, metadata=limits(at_least=1))
    max_len: int = field(default=32, metadata=limits(at_least=2, hint="tokens per sentence, after truncation"))
    max_train_examples: int | None = field(default=None, metadata=limits(at_least=1))
    adapter_dropout: float = field(default=0.1, metadata=limits(at_least=0, below=1))
    plm_dropout: float = field(default=0.0, metadata=limits(at_least=0, below=1))


@dataclass(frozen=True, kw_only=True)
class EncoderOptions(_Options):
    enc_adapter_dim: int = field(default=512, metadata=limits(at_least=1))
    eval_examples: int = field(default=500, metadata=limits(at_least=0, hint="0: no evaluation"))
    # held-out splits scored after training, each on eval_examples sentences spread over it; the first
    # also writes scores.json (the demo's), every one scores-SPLIT.json and SPLIT.src here
    eval_splits: tuple[Literal["valid", "test"], ...] = ("test",)
    eval_batch_size: int = field(default=32, metadata=limits(at_least=1))
    # "skip": train only on sentences of at most max_len source tokens, and evaluate on test sentences
    # that fit (the model reads no more); "truncate": cut every sentence to max_len
    long_sentences: Literal["truncate", "skip"] = "truncate"


@dataclass(frozen=True, kw_only=True)
class DecoderOptions(_Options):
    objective: Literal["ar", "cmlm"] = "cmlm"  # docs/abnet.md, "Which objective"
    enc_hidden: int = field(default=384, metadata=limits(at_least=1, hint="the encoder PLM's hidden size"))
    dec_adapter_ffn: int = field(default=1024, metadata=limits(at_least=1))
    dec_adapter_heads: int = field(default=12, metadata=limits(at_least=1))
    max_length_delta: int = field(default=32, metadata=limits(at_least=0))
    cross_init_std: float = field(default=0.02, metadata=limits(at_least=0))
    label_smoothing: float = field(default=0.1, metadata=limits(at_least=0, below=1))
    length_loss_weight: float = field(default=0.1, metadata=limits(at_least=0))
    decode_iterations: int = field(default=10, metadata=limits(at_least=1))
    beam: int = field(default=4, metadata=limits(at_least=1))
    # ar decoding, as fairseq: at most max_len_a * source tokens + max_len_b target tokens (None:
    # source length + max_length_delta), and no n-gram twice in a translation (0: allowed)
    max_len_a: float | None = field(default=None, metadata=limits(above=0))
    max_len_b: int = field(default=0, metadata=limits(at_least=0))
    no_repeat_ngram: int = field(default=0, metadata=limits(at_least=0))


def _abnet_config(options: _Options, **extra) -> AbnetConfig:
    return AbnetConfig(adapter_dropout=options.adapter_dropout, plm_dropout=options.plm_dropout,
                       adapter_layers=options.adapter_layers, **extra)


def _place(stage: Stage) -> None:
    """The stage's module on its device, with the optimiser both halves train with."""
    stage.module.to(stage.device)
    options = stage.options
    try:
        stage.optimizer, stage.scheduler = adam_with_warmup(stage.module.trainable_parameters(), options.lr,
                                                            options.warmup_steps, options.lr_schedule,
                                                            stage.context.job.train.steps)
    except ValueError as exc:
        raise ConfigError(f"[stages.{stage.context.name}]: {exc}") from None


def spread(total: int, n: int) -> list[int]:
    """`n` indices evenly spaced over `total` examples: the test file is grouped by source package,
    so its first n sentences would all come from one or two packages."""
    n = min(n, total)
    return [i * total // n for i in range(n)]


class AbnetEncoder(Stage):
    """Site a: frozen multilingual-e5-small + adapters; sends H_E, receives dL/dH_E."""

    Options = EncoderOptions
    outputs = BOUNDARY

    def __init__(self, context, options: EncoderOptions):
        super().__init__(context, options)
        self.pre = load_e5_small()
        self.data = TokenizedSide(str(context.data), "src", self.pre, options.max_len, options.max_train_examples)
        if options.model == "transformer":  # same tokenizer and cut vocabulary (paper Table 2's Transformer)
            pad = self.data.vmap.specials(self.pre.specials).pad
            self.module = BaselineEncoder(len(self.data.vmap), pad, BaselineConfig())
        else:
            config = _abnet_config(options, enc_adapter_dim=options.enc_adapter_dim)
            self.module = build_source_encoder(self.pre, config, self.data.vmap)
        if options.long_sentences == "skip":  # the decoder needs no filter: it looks targets up by id
            self.data.keep("train", self._fits("train"))
        _place(self)

    def examples(self, split: str) -> list[str]:
        return self.data.splits[split]["ids"]

    def _fits(self, split: str) -> list[bool]:
        """Per sentence of `split`: does its source fit in max_len tokens, untruncated?"""
        return [n <= self.options.max_len for n in self.data.splits[split]["lengths"]]

    def add_input(self, lines: list[str], first: int = 0) -> None:
        """Sentences to translate (not from the corpus), numbered from `first` (each id is used once):
        they replace the previous input, tokenized with the same vocabulary."""
        ids = [f"{INPUT_SPLIT}:{first + i}" for i in range(len(lines))]
        self.data.add_split(INPUT_SPLIT, lines, ids, self.pre, self.options.max_len)

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        ids, mask, _ = self.data.batch(batch.split, batch.indices)
        ids, mask = ids.to(self.device), mask.to(self.device)
        return Output(tensors={"hidden": self.module(ids, mask), "mask": mask})  # (B, S, H), (B, S)

    def after_training(self, runner) -> None:
        """Evaluate on `eval_examples` sentences of each of `eval_splits` across the sites; scores here."""
        if not self.options.eval_examples:
            return
        for n, split in enumerate(self.options.eval_splits):
            candidates = list(range(len(self.data.splits[split]["rows"])))
            if self.options.long_sentences == "skip":
                candidates = [i for i, fits in zip(candidates, self._fits(split)) if fits]
            chosen = [candidates[i] for i in spread(len(candidates), self.options.eval_examples)]
            # the sources of the sample, here at site a, where they are (the demo shows them beside the translations)
            (self.context.workdir / f"{split}.src").write_text(
                "".join(f"{self.data.splits[split]['text'][i]}\n" for i in chosen), encoding="utf-8")
            scores = json.dumps(single(runner.evaluate(split, chosen, self.options.eval_batch_size)), indent=1,
                                ensure_ascii=False)
            (self.context.workdir / f"scores-{split}.json").write_text(scores)
            if n == 0:
                (self.context.workdir / "scores.json").write_text(scores)


def single(scores: dict) -> dict:
    """The scores of a job with one sink (the decoder)."""
    if len(scores) != 1:
        raise StageError(f"expected the scores of one decoder, got those of {sorted(scores)}")
    return next(iter(scores.values()))


class AbnetDecoder(Stage):
    """Site b: frozen all-MiniLM-L6-v2 + cross-attention adapters, length predictor, output head."""

    Options = DecoderOptions
    inputs = BOUNDARY

    def __init__(self, context, options: DecoderOptions):
        super().__init__(context, options)
        self.pre = load_minilm()
        self.data = TokenizedSide(str(context.data), "tgt", self.pre, options.max_len, options.max_train_examples)
        if options.model == "transformer":
            self.module = BaselineDecoder(len(self.data.vmap), self.data.vmap.specials(self.pre.specials),
                                          BaselineConfig(objective=options.objective))
        else:
            config = _abnet_config(options, objective=options.objective, dec_adapter_ffn=options.dec_adapter_ffn,
                                   dec_adapter_heads=options.dec_adapter_heads,
                                   max_length_delta=options.max_length_delta,
                                   label_smoothing=options.label_smoothing,
                                   length_loss_weight=options.length_loss_weight,
                                   cross_init_std=options.cross_init_std)
            self.module = build_target_decoder(self.pre, config, options.enc_hidden, self.data.vmap)
        _place(self)

    def boundary(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden (B, S, H) float32, source mask (B, S)), or a DataError saying what differs."""
        hidden, src_mask = inputs["hidden"], inputs["mask"]
        if hidden.shape[:2] != src_mask.shape:
            raise DataError(f"received hidden {tuple(hidden.shape)} and mask {tuple(src_mask.shape)} do not "
                            "match: expected (B, S, H) and (B, S)")
        if hidden.shape[-1] != self.options.enc_hidden:
            raise DataError(f"the encoder sends hidden size {hidden.shape[-1]} but this decoder expects "
                            f"{self.options.enc_hidden}: set [stages.{self.context.name}].enc_hidden = "
                            f"{hidden.shape[-1]} in the job file (the encoder PLM's hidden size)")
        return hidden.float(), src_mask

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        hidden, src_mask = self.boundary(inputs)
        tgt_ids, tgt_mask, _ = self.data.batch("train", self.data.lookup("train", batch.ids))
        return Output(loss=self.module.loss(hidden, src_mask, tgt_ids.to(self.device), tgt_mask.to(self.device)).loss)

    def infer(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> list[list[str]]:
        """Beam search (ar) or mask-predict with a length beam (cmlm), beam 4 as the paper's ->
        [translation, reference] per sentence (no reference for `nebula translate`'s input)."""
        refs = None  # `nebula translate`'s input has none; a split this site lacks fails here, before decoding
        if batch.split != INPUT_SPLIT:
            refs = [self.data.splits[batch.split]["text"][i] for i in self.data.lookup(batch.split, batch.ids)]
        hidden, src_mask = self.boundary(inputs)
        o = self.options
        search = ({"max_len_a": o.max_len_a, "max_len_b": o.max_len_b, "no_repeat_ngram": o.no_repeat_ngram}
                  if o.objective == "ar" else {})
        rows = self.module.decode(hidden, src_mask, iterations=o.decode_iterations, beam=o.beam, **search)
        hyps = [detokenize(r, self.pre.tokenizer, self.data.vmap) for r in rows]
        if refs is None:
            return [[h, ""] for h in hyps]
        return [[h, r] for h, r in zip(hyps, refs)]

    def score(self, split: str, results: list[list[str]]) -> dict:
        """BLEU (sacrebleu, case-insensitive); {split}.hyp and {split}.ref stay here, beside the references,
        for significance tests such as `sacrebleu REF -i HYP_A HYP_B --paired-bs`."""
        hyps = [h for h, _ in results]
        if split == INPUT_SPLIT:
            return {"split": split, "n": len(hyps), "translations": hyps}
        refs = [r for _, r in results]
        for ext, lines in (("hyp", hyps), ("ref", refs)):
            (self.context.workdir / f"{split}.{ext}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        if not hyps:
            return {"split": split, "bleu": 0.0, "n": 0, "samples": []}
        # 1000 bootstrap resamples of the sentences (sacrebleu's, seeded): the half-width of the 95% interval
        bleu = BLEU(lowercase=True).corpus_score(hyps, [refs], n_bootstrap=BOOTSTRAP)
        # The scores go to the driver at the other site: hypotheses only, never a line of the references.
        return {"split": split, "bleu": bleu.score, "bleu_ci": bleu._ci, "n": len(hyps), "samples": hyps[:5]}
