"""The examples a split stage reads, by configuration, from its own copy under [job].data.

    tokens    a memory-mapped token file as nanoGPT's prepare.py writes (uint16, or uint32), cut into
              windows of seq_len + 1 tokens: input_ids (seq_len) and their next tokens as targets
    json      JSON lines, parquet, or a DatasetDict saved with save_to_disk, read with `datasets` from
    parquet   local files only (HF_DATASETS_OFFLINE): a text column (and a second, for pairs) tokenized
    disk      with a tokenizer.json, cut and padded to max_len; a label column as the target
    factory   "package.module:function": function(split, directory) returns a sequence of
              (inputs: dict of tensors, target: tensor) examples, optionally with `ids`

Examples are named "SPLIT:ROW" (or by an id column); the runtime sends their id hashes with every
message, and each stage finds its rows by them (`lookup`), so raw data never crosses a site.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from nebula import workload
from nebula.errors import ConfigError, DataError
from nebula.runtime.order import id_hash
from services.split.model import resolve_file
from services.split.options import DataSpec


class Examples(ABC):
    """Rows of each split: model inputs and targets by row, rows by example-id hash."""

    ids: dict[str, list[str]]  # split -> the example ids, in row order

    def __init__(self) -> None:
        self._by_hash: dict[str, dict[int, int]] = {}

    @abstractmethod
    def inputs(self, split: str, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The model's inputs for `rows`, batch first."""

    @abstractmethod
    def targets(self, split: str, rows: Sequence[int]) -> torch.Tensor:
        """What the loss compares the model's output with, for `rows`."""

    def lookup(self, split: str, hashes: torch.Tensor) -> list[int]:
        """Rows of the examples whose id hashes arrived with a message."""
        self._split(split)
        if split not in self._by_hash:
            self._by_hash[split] = {id_hash(i): n for n, i in enumerate(self.ids[split])}
        try:
            return [self._by_hash[split][int(h)] for h in hashes]
        except KeyError:
            raise DataError(f"an example id of split {split} is not in this site's data: do all sites hold the "
                            "same data (the same files, prepared the same way)?") from None

    def _split(self, split: str) -> None:
        if split not in self.ids:
            raise DataError(f"no split {split!r} in the data; it has {', '.join(self.ids)}")


def example_inputs(spec: DataSpec, batch: int, device: str | torch.device = "meta") -> dict[str, torch.Tensor]:
    """Model inputs of the shapes and dtypes one micro-batch of `batch` examples has (values do not matter):
    what the splitter traces."""
    if spec.format == "tokens":
        return {"input_ids": torch.zeros(batch, spec.seq_len, dtype=torch.int64, device=device)}
    if spec.format == "factory":
        if not spec.shapes:
            raise ConfigError("data.shapes is required with format = \"factory\": {input = [dtype, dims...]} per "
                              "model input, e.g. {x = [\"float32\", 16]}")
        return {name: torch.zeros(batch, *_dims(name, shape), dtype=_dtype(name, shape[0]), device=device)
                for name, shape in spec.shapes.items()}
    return {name: torch.ones(batch, spec.max_len, dtype=torch.int64, device=device) for name in spec.model_inputs}


def _dims(name: str, shape: list[Any]) -> list[int]:
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise ConfigError(f"data.shapes.{name} = {shape}: write [dtype, dims after the batch...]")
    return shape[1:]


def _dtype(name: str, text: Any) -> torch.dtype:
    dtype = getattr(torch, str(text), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"data.shapes.{name}: {text!r} is not a torch dtype (float32, int64, ...)")
    return dtype


def open_examples(spec: DataSpec, directory: Path | None, base: Path | None, cache: Path) -> Examples:
    """The examples `spec` describes, under the job's data `directory` (`base`: the job file's, for a
    tokenizer named by path; `cache`: where `datasets` may write, the stage's workdir)."""
    if spec.format == "factory":
        return FactoryExamples(spec, directory)
    if directory is None:
        raise ConfigError(f"data.format = {spec.format!r} reads files under [job].data, which the job does not set")
    if spec.format == "tokens":
        return TokenWindows(spec, directory)
    return TextTable(spec, directory, base, cache)


class TokenWindows(Examples):
    def __init__(self, spec: DataSpec, directory: Path):
        super().__init__()
        self.seq_len = spec.seq_len
        files = spec.files or {"train": "train.tokens", "valid": "valid.tokens"}
        self.tokens = {split: self._read(directory / name, spec) for split, name in files.items()}
        self.ids = {split: [f"{split}:{i}" for i in range((len(t) - 1) // self.seq_len)]
                    for split, t in self.tokens.items()}

    def _read(self, path: Path, spec: DataSpec) -> np.ndarray:
        if not path.exists():
            raise DataError(f"{path} does not exist: write it with `nebula data prepare-text` (or nanoGPT's "
                            "prepare.py), or name the files in data.files")
        tokens = np.memmap(path, dtype=np.dtype(spec.token_dtype).newbyteorder("<"), mode="r")
        if len(tokens) <= self.seq_len:
            raise DataError(f"{path} holds {len(tokens)} tokens, not one window of seq_len + 1 = {self.seq_len + 1}")
        return tokens

    def _windows(self, split: str, rows: Sequence[int]) -> torch.Tensor:
        self._split(split)
        T, tokens = self.seq_len, self.tokens[split]
        return torch.from_numpy(np.stack([tokens[i * T: i * T + T + 1] for i in rows]).astype(np.int64))  # (B, T+1)

    def inputs(self, split: str, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": self._windows(split, rows)[:, :-1]}

    def targets(self, split: str, rows: Sequence[int]) -> torch.Tensor:
        return self._windows(split, rows)[:, 1:]


class TextTable(Examples):
    """Texts (or text pairs) with a label per row, tokenized once when opened."""

    def __init__(self, spec: DataSpec, directory: Path, base: Path | None, cache: Path):
        super().__init__()
        if spec.tokenizer is None:
            raise ConfigError(f"data.format = {spec.format!r} needs data.tokenizer, a tokenizer.json")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(resolve_file(spec.tokenizer, base, "data.tokenizer")))
        tokenizer.enable_truncation(spec.max_len)
        tokenizer.enable_padding(length=spec.max_len, pad_id=tokenizer.token_to_id("[PAD]") or 0)
        self.spec, self.encoded, self.labels, self.ids = spec, {}, {}, {}
        for split, table in _tables(spec, directory, cache).items():
            columns = [c for c in (spec.text, spec.text_pair, spec.label, spec.id) if c is not None]
            missing = [c for c in columns if c not in table.column_names]
            if missing:
                raise DataError(f"data split {split!r} has no column {missing[0]!r}; it has {table.column_names}")
            texts = table[spec.text] if spec.text_pair is None else list(zip(table[spec.text], table[spec.text_pair]))
            encodings = tokenizer.encode_batch(texts)
            self.encoded[split] = {
                "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.int64),
                "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64),
                "token_type_ids": torch.tensor([e.type_ids for e in encodings], dtype=torch.int64)}
            self.labels[split] = torch.tensor(table[spec.label])
            self.ids[split] = ([str(i) for i in table[spec.id]] if spec.id else
                               [f"{split}:{i}" for i in range(len(table))])

    def inputs(self, split: str, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        self._split(split)
        return {name: self.encoded[split][name][list(rows)] for name in self.spec.model_inputs}

    def targets(self, split: str, rows: Sequence[int]) -> torch.Tensor:
        self._split(split)
        return self.labels[split][list(rows)]


def _tables(spec: DataSpec, directory: Path, cache: Path) -> dict[str, Any]:
    """split -> a `datasets.Dataset`, from local files only; `datasets` writes its Arrow copy under `cache`
    (not in $HOME, and not beside the data, which a site may grant read-only)."""
    # read by datasets when it is imported: it never asks the Hub
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.disable_progress_bars()  # a stage's log shows its steps, not a bar per split it reads
    if spec.format == "disk":
        loaded = datasets.load_from_disk(str(directory / spec.files.get("all", "")))
        if not isinstance(loaded, datasets.DatasetDict):
            raise DataError(f"{directory}: save_to_disk of a DatasetDict (its splits) is expected, not a Dataset")
        return dict(loaded)
    files = spec.files or {"train": f"train.{'jsonl' if spec.format == 'json' else 'parquet'}",
                           "valid": f"valid.{'jsonl' if spec.format == 'json' else 'parquet'}"}
    paths = {split: str(directory / name) for split, name in files.items()}
    for split, path in paths.items():
        if not Path(path).is_file():
            raise DataError(f"data split {split!r}: {path} does not exist")
    return dict(datasets.load_dataset(spec.format, data_files=paths, cache_dir=str(cache / "datasets-cache")))


class FactoryExamples(Examples):
    def __init__(self, spec: DataSpec, directory: Path | None):
        super().__init__()
        if spec.factory is None:
            raise ConfigError("data.format = \"factory\" needs data.factory = \"package.module:function\"")
        make = workload.load(spec.factory, "data.factory")
        self.splits = {split: make(split, directory) for split in spec.files or {"train": "", "valid": ""}}
        self.ids = {split: list(getattr(rows, "ids", [f"{split}:{i}" for i in range(len(rows))]))
                    for split, rows in self.splits.items()}

    def _examples(self, split: str, rows: Sequence[int]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        self._split(split)
        return [self.splits[split][i] for i in rows]

    def inputs(self, split: str, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        examples = self._examples(split, rows)
        return {name: torch.stack([x[name] for x, _ in examples]) for name in examples[0][0]}

    def targets(self, split: str, rows: Sequence[int]) -> torch.Tensor:
        return torch.stack([torch.as_tensor(y) for _, y in self._examples(split, rows)])
