"""`nebula stage run`: one stage service of a job, connected through its site's gateway."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("stage", help="run a stage service of a job")
    stage_sub = parser.add_subparsers(dest="stage_command", required=True, metavar="ACTION")
    run = stage_sub.add_parser("run", help="run one stage until the job is done (resumes from its workdir)")
    run.add_argument("--job", required=True, help="job file (TOML), e.g. deploy/jobs/abnet-es-en.toml")
    run.add_argument("--stage", required=True, help="stage name in the job file, e.g. encoder")
    run.add_argument("--site", required=True, help="site config (TOML) of the site this stage runs at")
    run.add_argument("--workdir", required=True, help="where checkpoints, metrics and results go")
    run.add_argument("--steps", type=int, help="override [train].steps")
    run.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    run.set_defaults(func=run_stage, supervised=True)
    one = stage_sub.add_parser("one-site", help="run every stage of a job in one process (no WAN): the "
                               "intra-cluster phase whose checkpoints hot-start a cross-site run")
    one.add_argument("--job", required=True, help="job file (TOML)")
    one.add_argument("--workdir", required=True, help="one sub-directory per stage is written here")
    one.add_argument("--steps", type=int, help="override [train].steps")
    one.set_defaults(func=one_site)


def _job(args):
    import dataclasses

    from nebula.runtime.job import load_job
    job = load_job(args.job)
    if args.steps:
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=args.steps))
    return job


def one_site(args) -> int:
    from nebula.runtime.onesite import run_one_site
    run_one_site(_job(args), Path(args.workdir))
    print(f"one-site run done; hot-start a cross-site run with: nebula demo --hot-start {args.workdir}")
    return 0


def run_stage(args) -> int:
    import torch

    from nebula.runtime.registry import resolve_stage
    from nebula.transport.config import load_site_config
    from nebula.transport.reliable import open_channel

    job = _job(args)
    site = load_site_config(args.site)
    stage_cfg = job.stage(args.stage)
    torch.set_num_threads(int(stage_cfg.options.get("threads", 1)))  # one core per site on a shared host
    stage = resolve_stage(stage_cfg.impl)(job, args.stage, Path(args.workdir), quiet=args.quiet)
    with open_channel(site, stage_cfg.address) as channel:
        stage.run(channel)
    return 0
