"""The token windows a GPT stage trains on: `nebula data prepare-text`'s uint16 id files, cut into
examples of seq_len + 1 tokens (inputs and their next-token targets), each named "split:i".

Every stage reads its own copy (data stays at its site; only example-id hashes cross the WAN): the
first stage its inputs by position, later stages their tokens (for `reembed`) and the last its targets
by the ids each message carries.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nebula.errors import DataError
from nebula.runtime.order import id_hash

SPLITS = ("train", "valid")


class TokenWindows:
    def __init__(self, directory: str | Path, seq_len: int, vocab_size: int):
        self.dir, self.seq_len = Path(directory), seq_len
        self.tokens = {split: self._read(split, vocab_size) for split in SPLITS}
        self.ids = {split: [f"{split}:{i}" for i in range((len(t) - 1) // seq_len)] for split, t in self.tokens.items()}
        self._rows: dict[str, dict[int, int]] = {}

    def _read(self, split: str, vocab_size: int) -> np.ndarray:
        path = self.dir / f"{split}.tokens"
        if not path.exists():
            raise DataError(f"{path} does not exist: build the corpus with `nebula data prepare-text --out {self.dir}`")
        tokens = np.fromfile(path, dtype="<u2")
        if len(tokens) <= self.seq_len:
            raise DataError(f"{path} holds {len(tokens)} tokens, not one window of seq_len + 1 = {self.seq_len + 1}")
        if int(tokens.max()) >= vocab_size:
            raise DataError(f"{path} has token id {int(tokens.max())} but the model's vocab_size is {vocab_size}: "
                            f"set vocab_size to the corpus's (its manifest.json says `vocab`)")
        return tokens

    def windows(self, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, (B, T) int64 each, of the windows at `indices`."""
        if split not in self.tokens:
            raise DataError(f"no split {split!r} in {self.dir}; it has {', '.join(SPLITS)}")
        T, tokens = self.seq_len, self.tokens[split]
        rows = np.stack([tokens[i * T: i * T + T + 1] for i in indices]).astype(np.int64)  # (B, T + 1)
        rows_t = torch.from_numpy(rows)
        return rows_t[:, :-1], rows_t[:, 1:]

    def lookup(self, split: str, hashes: torch.Tensor) -> list[int]:
        """Window indices of the examples whose id hashes arrived with a message."""
        if split not in self._rows:
            self._rows[split] = {id_hash(i): n for n, i in enumerate(self.ids[split])}
        rows = self._rows[split]
        try:
            return [rows[int(h)] for h in hashes]
        except KeyError:
            raise DataError(f"an example id of split {split} is not in {self.dir}: do all sites hold the same "
                            "corpus (same `nebula data prepare-text` and seq_len)?") from None
