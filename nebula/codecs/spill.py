"""Where `delta`'s cached rows go when they do not fit in memory: one file per stream.

The file is anonymous (created and unlinked at once, `tempfile.TemporaryFile`, O_TMPFILE on Linux), so
the operating system frees its space when the cache is dropped or the process ends, however it ends: a
killed stage leaves no gigabytes behind. It does not show in `ls`; the caches' stats report its size
(`disk_file_bytes`).

Rows are float32 of many sizes (a sequence's padded lengths), so the file is cut in 4 KiB blocks and a
row takes any free ones, consecutive where it can (one system call per run of blocks): the file stays
within a block per row of the bytes it holds, and no compaction pass ever stalls a step.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

BLOCK = 4096


class SpillFile:
    def __init__(self, directory: str | Path | None = None):
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory, prefix="nebula-delta-")
        self._free: list[int] = []  # numbers of free blocks inside the file
        self.blocks = 0  # the file's length in blocks
        self.bytes = 0  # of the rows held

    @property
    def end(self) -> int:
        """The file's size in bytes: the rows held, the rest of their last blocks, and free blocks."""
        return self.blocks * BLOCK

    def write(self, row: torch.Tensor) -> list[int]:
        """Store a float32 row; the blocks that hold it. An OSError (a full disk) leaves the file's
        bookkeeping as it was."""
        data = row.detach().contiguous().numpy().data.cast("B")
        count = -(-len(data) // BLOCK)
        reused = sorted(self._free[-count:]) if count else []
        blocks = reused + list(range(self.blocks, self.blocks + count - len(reused)))
        for first, start, stop in _runs(blocks, len(data)):  # a failure here has taken nothing yet
            _pwrite_all(self._file.fileno(), data[start:stop], first * BLOCK)
        del self._free[len(self._free) - len(reused):]
        self.blocks += count - len(reused)
        self.bytes += len(data)
        return blocks

    def read(self, blocks: list[int], shape: torch.Size) -> torch.Tensor:
        row = torch.empty(shape, dtype=torch.float32)
        view = row.numpy().data.cast("B")
        for first, start, stop in _runs(blocks, len(view)):
            done = start
            while done < stop:
                got = os.preadv(self._file.fileno(), [view[done:stop]], first * BLOCK + done - start)
                if got == 0:
                    raise OSError(f"the spill file ends inside block {first}")
                done += got
        return row

    def free(self, blocks: list[int], shape: torch.Size) -> None:
        self._free.extend(blocks)
        self.bytes -= shape.numel() * 4

    def close(self) -> None:
        self._file.close()


def _runs(blocks: list[int], size: int):
    """(first block, start, stop): the row's bytes [start, stop) go to consecutive blocks from `first`."""
    first = start = 0
    for i, block in enumerate(blocks):
        if i == 0 or block != blocks[i - 1] + 1:
            if i:
                yield first, start, i * BLOCK
            first, start = block, i * BLOCK
    if blocks:
        yield first, start, size


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
