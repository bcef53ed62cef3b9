"""`nebula audit verify|show PATH`: check a hash-chained audit log series, or print its records.

PATH is a series' live file (e.g. audit/gateway.jsonl, whose rotated archives gateway.000001.jsonl, ...
sit beside it), one of its archives, or a directory (every *.jsonl series in it)."""
from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from nebula.errors import ConfigError, DataError
from nebula.security.audit import verify
from nebula.security.audit_series import series_base, series_files, series_in

PATH_HELP = "the live file of a log (its archives are found beside it), one archive, or a directory"


def register(sub) -> None:
    parser = sub.add_parser("audit", help="verify or show a tamper-evident audit log")
    audit_sub = parser.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    p = audit_sub.add_parser("verify", help="check every record's hash chain across the log's files; "
                                            "exit 1 at the first bad one")
    p.add_argument("path", type=Path, help=PATH_HELP)
    p.add_argument("--anchor", metavar="SEQ:HASH",
                   help="a head recorded earlier (printed by verify); detects records removed from the end")
    p.set_defaults(func=_verify)
    p = audit_sub.add_parser("show", help="print records, oldest file first")
    p.add_argument("path", type=Path, help="the live file of a log, or one archive (the whole series is shown)")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N records")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.set_defaults(func=_show)


def _verify(args) -> int:
    bases = _bases(args.path)
    if args.anchor and len(bases) > 1:
        raise ConfigError(f"--anchor names one log, but {args.path} holds {len(bases)}: "
                          f"{', '.join(b.name for b in bases)}; pass one of them")
    anchor = _parse_anchor(args.anchor) if args.anchor else None
    failed = 0
    for base in bases:
        result = verify(base, anchor)
        print(f"{base}: {result}" if result.ok else f"FAILED {base}: {result}")
        if result.ok:
            print(f"anchor: {result.head[0]}:{result.head[1]}")
        failed += not result.ok
    return 1 if failed else 0


def _bases(path: Path) -> list[Path]:
    if not path.is_dir():
        return [series_base(path)]
    bases = series_in(path)
    if not bases:
        raise DataError(f"{path} holds no audit log (*.jsonl); pass the log's file instead")
    return bases


def _parse_anchor(text: str) -> tuple[int, str]:
    seq, _, digest = text.partition(":")
    if not seq.isdigit() or len(digest) != 64:
        raise ConfigError(f"--anchor {text!r} is not SEQ:HASH (as printed by `nebula audit verify`)")
    return int(seq), digest


def _show(args) -> int:
    files = series_files(series_base(args.path))
    if not files:
        raise DataError(f"cannot read audit log {args.path}: no such file, nor archives of it")
    try:
        lines = deque((line for file in files for line in file.open()), maxlen=args.tail or None)
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
