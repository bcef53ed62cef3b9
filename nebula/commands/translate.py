"""`nebula translate`: cross-site inference, the encoder here (site a), the decoder at site b."""
from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("translate", help="translate sentences with a trained two-site job: encode at "
                            "the first stage's site, decode at the second's")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                        help="a run made by `nebula demo` (keys, site configs, checkpoints)")
    parser.add_argument("--job", type=Path, default=None, help="job file (default: deploy/jobs/abnet-es-en.toml)")
    parser.add_argument("--input", default="-", help="one source sentence per line (default: stdin)")
    parser.set_defaults(func=translate)


def translate(args) -> int:
    from nebula.demo import ROOT
    from nebula.errors import ConfigError
    from nebula.launch import ProcessGroup, start_gateway, start_stage
    from nebula.runtime.job import load_job
    from nebula.runtime.registry import resolve_stage
    from nebula.transport.config import load_site_config
    from nebula.transport.reliable import open_channel

    job_file = args.job or ROOT / "deploy" / "jobs" / "abnet-es-en.toml"
    job = load_job(job_file)
    head, tail = list(job.stages)
    sites = {site: args.run_dir / f"site-{site}.toml" for site in ("a", "b")}
    if not all(path.exists() for path in sites.values()):
        raise ConfigError(f"{args.run_dir} has no site configs: run `nebula demo --run-dir {args.run_dir}` first")
    text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError("nothing to translate: give one sentence per line")
    group = ProcessGroup()
    try:
        for site, config in sites.items():
            start_gateway(group, args.run_dir, site, config)
        start_stage(group, args.run_dir, job_file, tail, sites[job.stage(tail).site])
        stage = resolve_stage(job.stage(head).impl)(job, head, args.run_dir / head, quiet=True)
        with open_channel(load_site_config(sites[job.stage(head).site]), job.stage(head).address) as channel:
            for line in stage.translate(channel, lines):
                print(line)
    finally:
        group.stop()
    return 0
