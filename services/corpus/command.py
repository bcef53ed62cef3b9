"""`nebula data prepare`: build es-en / zh-en parallel corpora from Debian translation packages.

An action of the framework's `nebula data` (nebula/commands/data.py, beside register|grant|revoke|list),
added by the corpus tooling's spec (services/corpus/workload.py)."""
from __future__ import annotations

import time
from pathlib import Path


def register(data_sub) -> None:
    prep = data_sub.add_parser(
        "prepare", help="download Debian translation packages and write train/valid/test parallel text (docs/data.md)"
    )
    prep.add_argument("--pairs", default="es-en,zh-en", help="comma-separated language pairs (default: %(default)s)")
    prep.add_argument("--out", type=Path, default=Path("data"), help="output directory (default: %(default)s)")
    prep.add_argument("--cache", type=Path, default=Path(".cache/debs"), help=".deb cache (default: %(default)s)")
    prep.add_argument("--max-len", type=int, default=64, help="longest side, in words/CJK chars (default: %(default)s)")
    prep.add_argument("--min-len", type=int, default=1, help="shortest side, in words/CJK chars (default: %(default)s)")
    prep.add_argument("--seed", type=int, default=0, help="seed choosing the held-out packages (default: %(default)s)")
    for split in ("valid", "test"):
        prep.add_argument(f"--{split}-fraction", type=float, default=0.05,
                          help=f"about this share of pairs, as whole packages, for {split} (default: %(default)s)")
    prep.set_defaults(func=prepare_command)


def prepare_command(args) -> int:
    # why here: the corpus tooling (~20 ms), kept off `nebula --help`
    from services.corpus.clean import Filter
    from services.corpus.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        pairs=tuple(p.strip() for p in args.pairs.split(",") if p.strip()),
        out=args.out,
        cache=args.cache,
        filter=Filter(min_len=args.min_len, max_len=args.max_len),
        seed=args.seed,
        valid_fraction=args.valid_fraction,
        test_fraction=args.test_fraction,
    )
    started = time.monotonic()
    manifests = prepare(cfg, log=lambda message: print(message, flush=True))
    print(summary_table(manifests))
    print(f"wrote {', '.join(str(cfg.out / p) for p in manifests)} in {time.monotonic() - started:.0f} s")
    return 0


def summary_table(manifests: dict[str, dict]) -> str:
    rows = [("pair", "train", "valid", "test", "valid packages", "test packages")]
    for pair, m in manifests.items():
        s = m["splits"]
        rows.append((pair, str(s["train"]), str(s["valid"]), str(s["test"]),
                     ",".join(m["valid_packages"]), ",".join(m["test_packages"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
