"""`nebula stage run|one-site`: one stage service of a job, or every stage of it in one process.

`stage run` is a stage's entry point: what the process is told from outside (the job it runs for,
the status file and metrics its supervisor asks for) is read here, once, and handed to the runtime.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from nebula.errors import ConfigError


def register(sub) -> None:
    parser = sub.add_parser("stage", help="run a stage service of a job")
    stage_sub = parser.add_subparsers(dest="stage_command", required=True, metavar="ACTION")
    run = stage_sub.add_parser("run", help="run one stage until the job is done (resumes from its workdir); "
                               "a stage with ranks = N: start N of these with torchrun's variables")
    run.add_argument("--job", required=True, help="job file (TOML), e.g. deploy/jobs/NAME.toml")
    run.add_argument("--stage", required=True, help="stage name in the job file, as in [stages.NAME]; with "
                     "[replicas], replica k's is NAME-rK (docs/replicas.md)")
    run.add_argument("--site", required=True, help="site config (TOML) of the site this stage runs at")
    run.add_argument("--workdir", required=True, help="where checkpoints, metrics and results go")
    run.add_argument("--steps", type=int, help="override [train].steps")
    run.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    run.add_argument("--job-id", help="the submitted job this stage runs for (`nebula job submit` passes it): "
                     "[job].data = \"dataset:NAME\" is read through that job's grants")
    run.add_argument("--user", help="the owner of --job-id (checked against the job's record)")
    run.set_defaults(func=run_stage, supervised=True)
    one = stage_sub.add_parser("one-site", help="run every stage of a job in one process (no WAN): the "
                               "intra-cluster phase whose checkpoints hot-start a cross-site run")
    one.add_argument("--job", required=True, help="job file (TOML)")
    one.add_argument("--workdir", required=True, help="one sub-directory per stage is written here")
    one.add_argument("--steps", type=int, help="override [train].steps")
    one.add_argument("--until", type=int, metavar="N", help="stop after step N of the job (an intra-cluster phase "
                     "of a longer job: learning-rate schedules span all [train].steps)")
    one.set_defaults(func=one_site)
    res = stage_sub.add_parser("resolve", help="measure the stages and fix ranks = \"auto\" (paper §3.3's n): "
                               "every site then runs the resolved job file")
    res.add_argument("--job", required=True, help="job file (TOML) with a stage of ranks = \"auto\"")
    res.add_argument("--out", required=True, help="where the resolved job file is written")
    res.set_defaults(func=resolve)


def load(job_file: str, steps: int | None = None):
    """The job file, with [train].steps replaced by `steps` if given."""
    # why here: torch (a job file imports its stages), kept off `nebula --help`
    from nebula.runtime.job import load_job

    job = load_job(job_file)
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps {steps}: must be a positive integer")
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=steps))
    return job


def one_site(args) -> int:
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.onesite import run_one_site

    run_one_site(load(args.job, args.steps), Path(args.workdir), until=args.until)
    print(f"one-site run done; hot-start a cross-site run with its checkpoints: {args.workdir}/<stage>/checkpoints "
          f"(nebula demo --hot-start {args.workdir})")
    return 0


def run_stage(args) -> int:
    # why here: torch, pynacl, prometheus_client, kept off `nebula --help`
    from nebula.observe.observer import Observing
    from nebula.observe.stage import StageWatch
    from nebula.security.grants import Principal
    from nebula.site.stage_service import run_stage as run

    principal = Principal.of_job(args.job_id, args.user)  # --job-id, --user: as the job's supervisor said
    observing = Observing.from_env()  # the status file and metrics the supervisor asks for, if any
    run(load(args.job, args.steps), args.stage, Path(args.workdir), Path(args.site), quiet=args.quiet,
        principal=principal, observe=functools.partial(StageWatch.start, observing) if observing else None)
    return 0


def resolve(args) -> int:
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.autoranks import resolve as resolve_ranks

    path, evidence = resolve_ranks(Path(args.job), Path(args.out))
    print(f"{path}" if evidence else f"{args.job} has no stage with ranks = \"auto\": nothing to resolve")
    return 0
