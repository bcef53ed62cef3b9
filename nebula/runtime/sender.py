"""Background sending: encoding and transfer of micro-batch i overlap the compute of i+1."""
from __future__ import annotations

import queue
import threading
from typing import Callable

from nebula.errors import NebulaError, TransportError
from nebula.transport.base import Channel
from nebula.wire import Message


class BackgroundSender:
    """One thread that builds (encodes) and sends messages in submission order."""

    def __init__(self, channel: Channel, timeout: float):
        self._channel, self._timeout = channel, timeout
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="nebula-sender", daemon=True)
        self._thread.start()

    def submit(self, build: Callable[[], Message]) -> None:
        """`build` runs on the sender thread (codec work happens there, off the compute path)."""
        self._raise_if_failed()
        self._queue.put(build)

    def flush(self) -> None:
        """Wait until everything submitted has been handed to the channel."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self._timeout)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransportError(f"background send failed: {self._error}") from self._error

    def _loop(self) -> None:
        while (build := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._channel.send(build(), timeout=self._timeout)
            except (NebulaError, RuntimeError, ValueError) as exc:
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()
