"""`nebula translate`: cross-site inference with a trained job: encode here, decode at site b."""
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
    from nebula.errors import ConfigError
    from nebula.launch import start_sites
    from nebula.runtime.job import load_job
    from nebula.runtime.service import build_stage, make_runner
    from nebula.transport.config import load_site_config
    from nebula.transport.reliable import open_channel
    from services.abnet.demo import DEFAULT_JOB
    from services.abnet.stages import INPUT_SPLIT, single

    job_file = args.job or DEFAULT_JOB
    job = load_job(job_file)
    driver = job.graph.coordinator
    if not (args.run_dir / f"site-{job.stage(driver).site}.toml").exists():
        raise ConfigError(f"{args.run_dir} has no site configs: run `nebula demo --run-dir {args.run_dir}` first")
    text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError("nothing to translate: give one sentence per line")
    group = start_sites(args.run_dir, job_file, skip=(driver,), keys=False)
    try:
        stage = build_stage(job, driver, args.run_dir / driver, quiet=True)
        stage.add_input(lines)
        site = load_site_config(args.run_dir / f"site-{job.stage(driver).site}.toml")
        with open_channel(site, job.stage(driver).address) as channel:
            runner = make_runner(job, driver, stage, channel)
            try:
                scores = runner.run(hook=lambda r: r.evaluate(INPUT_SPLIT, list(range(len(lines))),
                                                              stage.options.eval_batch_size), train=False)
            finally:
                runner.close()
    finally:
        group.stop()
    for line in single(scores)["translations"]:
        print(line)
    return 0
