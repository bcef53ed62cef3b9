"""Torch on one thread, for tests of small or size-only tensor work on a shared 2-core machine."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Small ops, or sizes that do not depend on speed: a second OpenMP thread that must wait for a busy
    core made the ABNet model tests 30x slower (0.36 s vs 11.8 s measured) and lowrank 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
