"""Background sending: encoding and transfer of micro-batch i overlap the compute of i+1."""
from __future__ import annotations

import queue
import threading
from typing import Callable

from nebula.errors import LinkDown, NebulaError, StageError, TransportError
from nebula.transport.base import Channel
from nebula.wire import Message


class BackgroundSender:
    """One thread that builds (encodes) and sends messages in submission order.

    Any exception in a build or a send (a codec bug, a TypeError, a dead link) is kept and raised
    by the next `submit`, `flush` or `settle` on the stage's thread; later work is skipped, never
    left waiting, so `flush` cannot hang on a dead thread. A send that failed is the link's failure
    (TransportError: a restart may cure it); a build that failed is the stage's own (StageError: what it
    sends cannot be encoded, e.g. a NaN an `fp16` link refuses, and a restart fails the same way). Both
    were a TransportError, so such a stage was restarted as a crash, resumed, failed again and left its
    peers waiting for it (issue 55: the `fp16` hang); now it stops and tells them why.
    """

    def __init__(self, channel: Channel, timeout: float):
        self._channel, self._timeout = channel, timeout
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._error: BaseException | None = None
        self._building = False  # whether _error came from a build (the stage's) rather than a send (the link's)
        self._submitted = self._built = 0
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="nebula-sender", daemon=True)
        self._thread.start()

    def submit(self, build: Callable[[], Message]) -> None:
        """`build` runs on the sender thread (codec work happens there, off the compute path)."""
        self._raise_if_failed()
        with self._progress:
            self._submitted += 1
        self._queue.put(build)

    def flush(self) -> None:
        """Wait until everything submitted has been handed to the channel."""
        self._queue.join()
        self._raise_if_failed()

    def settle(self) -> None:
        """Wait until everything submitted has been built (codec state is then final), not sent."""
        with self._progress:
            self._progress.wait_for(lambda: self._built >= self._submitted or self._error is not None)
        self._raise_if_failed()

    def discard(self) -> None:
        """Drop what is queued and not built yet (messages of an abandoned generation), then settle."""
        while True:
            try:
                build = self._queue.get_nowait()
            except queue.Empty:
                break
            if build is None:  # close() raced us: keep its sentinel
                self._queue.task_done()
                self._queue.put(None)
                break
            self._done(skipped=True)
        with self._progress:
            self._progress.wait_for(lambda: self._built >= self._submitted)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self._timeout)

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, LinkDown):
            raise LinkDown(str(self._error)) from self._error  # the job stops (exit 3), as on the stage's thread
        if self._error is not None and self._building:
            raise StageError(f"a message could not be built for sending: {type(self._error).__name__}: "
                             f"{self._error}") from self._error
        if self._error is not None:
            if isinstance(self._error, NebulaError):
                raise TransportError(f"background send failed: {self._error}") from self._error
            raise TransportError(f"background send failed with {type(self._error).__name__}: "
                                 f"{self._error}") from self._error

    def _loop(self) -> None:
        while (build := self._queue.get()) is not None:
            message = None
            try:
                if self._error is None:
                    message = build()
            except BaseException as exc:  # noqa: BLE001 - kept and raised on the stage's thread
                self._error, self._building = exc, True
            finally:
                self._done()
            try:
                if message is not None and self._error is None:
                    self._channel.send(message, timeout=self._timeout)
            except BaseException as exc:  # noqa: BLE001 - as above
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _done(self, skipped: bool = False) -> None:
        with self._progress:
            self._built += 1
            self._progress.notify_all()
        if skipped:
            self._queue.task_done()
