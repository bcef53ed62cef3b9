"""Giving the memory of a dropped queue back to the system, not keeping it for the next flood.

What a next hop held (issue 42, class 6: up to `queue_bytes` of received frames, trackers and their
bookkeeping) is freed by libzmq's I/O threads and by this process when the hop takes it or drops it (a
stage that never read hangs up). glibc's allocator keeps freed memory in its arenas for reuse: after a
256 KiB flood toward a stage that never reads, a gateway stayed 177 MiB above its start (measured with
`nebula bench flood --only stalled`), 48 MiB after 1 KiB messages. `Reclaim` watches the bytes the
queues hold and, once they fell by `threshold` since their peak, asks the allocator to return its free
pages (`malloc_trim(0)`, which madvises free pages in every arena, the I/O threads' too). It costs a walk
of the heap, a few milliseconds, once per drained queue; nothing where libc has no malloc_trim.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable

log = logging.getLogger("nebula.gateway")
THRESHOLD = 16 << 20  # bytes the queues must have let go since their peak before the allocator is asked


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class Reclaim:
    def __init__(self, threshold: int = THRESHOLD, trim: Callable[[], None] | None = None) -> None:
        self.threshold = threshold
        self.trim = trim if trim is not None else _malloc_trim()
        self.peak = 0  # the most the queues held since the last trim
        self.trims = 0

    def observe(self, held: int) -> bool:
        """The queues hold `held` bytes now; -> whether the allocator was asked to give memory back."""
        self.peak = max(self.peak, held)
        if self.peak - held < self.threshold or self.trim is None:
            return False
        self.trim()
        self.trims += 1
        log.debug("returned the memory of %d MiB of drained queues to the system", (self.peak - held) >> 20)
        self.peak = held
        return True
