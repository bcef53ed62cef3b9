"""A site's real gateway that also records every frame it sends towards another site
(tests/e2e/test_data_stays.py).

    python -m tests.support.recording_gateway RECORD SITE.toml

It runs `nebula gateway run` unchanged but for one thing: `send` of the sockets that reach other
sites (the DEALER to each peer gateway, and the external ROUTER, which answers peers) is wrapped
to append each frame it sent to RECORD. This is the last point where the bytes are plaintext: libzmq
encrypts them with CURVE below `send`. Frames sent on the internal socket (to this site's own
stages) are not recorded: they never leave the site.

RECORD holds, per frame: socket (1 byte: 0 peer DEALER, 1 external ROUTER), more (1 byte: another
frame of the same message follows), length (8 bytes, little-endian), the frame's bytes.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO

import zmq

from nebula import cli
from nebula.gateway import main as gateway_main
from nebula.gateway.server import Gateway

FRAME = struct.Struct("<BBQ")  # socket, more, length
PEER, EXTERNAL = 0, 1


def read_record(path: Path) -> list[tuple[int, list[bytes]]]:
    """RECORD -> [(socket, frames of one message)] in the order they were sent."""
    data, at, messages, frames = path.read_bytes(), 0, [], []
    while at < len(data):
        socket, more, length = FRAME.unpack_from(data, at)
        at += FRAME.size
        frames.append(data[at:at + length])
        at += length
        if not more:
            messages.append((socket, frames))
            frames = []
    if frames:
        raise ValueError(f"{path} ends inside a message ({len(frames)} frames without the last)")
    return messages


def _record_sends(sock: zmq.Socket, which: int, out: BinaryIO) -> None:
    """Wrap sock.send (which send_multipart calls per frame) to write each frame it sent to `out`."""
    send = sock.send

    def recording_send(data: Any, flags: int = 0, *args: Any, **kwargs: Any) -> Any:
        frame = data.bytes if isinstance(data, zmq.Frame) else bytes(data)  # before send may move it
        result = send(data, flags, *args, **kwargs)  # recorded only once libzmq took it
        out.write(FRAME.pack(which, bool(flags & zmq.SNDMORE), len(frame)) + frame)
        return result

    sock.send = recording_send


class RecordingGateway(Gateway):
    record_path: Path  # set by main() before the gateway is built

    def start(self) -> RecordingGateway:
        self.record = open(self.record_path, "ab", buffering=0)  # unbuffered: a killed gateway loses nothing
        open_link = self.links._open

        def recording_open(name: str, cert: Any) -> None:  # links open at start and whenever trust changes
            open_link(name, cert)
            _record_sends(self.links.sockets[name], PEER, self.record)

        self.links._open = recording_open
        super().start()
        _record_sends(self.external, EXTERNAL, self.record)
        return self

    def close(self) -> None:
        super().close()
        if getattr(self, "record", None) is not None:
            self.record.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.support.recording_gateway RECORD SITE.toml", file=sys.stderr)
        return 2
    RecordingGateway.record_path = Path(argv[0])
    gateway_main.Gateway = RecordingGateway  # the real command builds this subclass instead
    return cli.main(["gateway", "run", "--site-config", argv[1]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
