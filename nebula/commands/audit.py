"""`nebula audit verify|show PATH`: check a hash-chained audit log, or print its records."""
from __future__ import annotations

import json
import time
from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("audit", help="verify or show a tamper-evident audit log")
    audit_sub = parser.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    p = audit_sub.add_parser("verify", help="check every record's hash chain; exit 1 at the first bad one")
    p.add_argument("path", type=Path)
    p.add_argument("--anchor", metavar="SEQ:HASH",
                   help="a head recorded earlier (printed by verify); detects records removed from the end")
    p.set_defaults(func=_verify)
    p = audit_sub.add_parser("show", help="print records")
    p.add_argument("path", type=Path)
    p.add_argument("--tail", type=int, metavar="N", help="only the last N records")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.set_defaults(func=_show)


def _verify(args) -> int:
    from nebula.security.audit import verify

    result = verify(args.path, _parse_anchor(args.anchor) if args.anchor else None)
    print(result if result.ok else f"{args.path}: {result}")
    if result.ok:
        print(f"anchor: {result.head[0]}:{result.head[1]}")
    return 0 if result.ok else 1


def _parse_anchor(text: str) -> tuple[int, str]:
    from nebula.errors import ConfigError

    seq, _, digest = text.partition(":")
    if not seq.isdigit() or len(digest) != 64:
        raise ConfigError(f"--anchor {text!r} is not SEQ:HASH (as printed by `nebula audit verify`)")
    return int(seq), digest


def _show(args) -> int:
    from collections import deque

    from nebula.errors import DataError

    try:
        with args.path.open() as f:
            lines = deque(f, maxlen=args.tail) if args.tail else list(f)
    except OSError as exc:
        raise DataError(f"cannot read audit log {args.path} ({exc})") from exc
    for line in lines:
        print(line.rstrip("\n") if args.json else _format(line))
    return 0


def _format(line: str) -> str:
    try:
        record = json.loads(line)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record["ts"]))
        rest = " ".join(f"{k}={json.dumps(v)}" for k, v in record.items()
                        if k not in ("seq", "ts", "event", "prev", "hash"))
        return f"{record['seq']:>6} {when} {record['event']} {rest}".rstrip()
    except (ValueError, KeyError, TypeError):
        return f"     ? (malformed) {line.rstrip()}"
