"""Slurm as a site's scheduler: a service's batch script, and the commands that submit (sbatch), watch
(squeue, sacct), check (sbatch --test-only, scontrol, sacctmgr) and cancel (scancel) its job.

A stage with `ranks = N` is one job of N tasks that srun starts under torchrun's conventions, as
torchtitan's multinode Slurm script does (there with one torchrun per node, here one task per rank):

    RANK = SLURM_PROCID    WORLD_SIZE = SLURM_NTASKS    LOCAL_RANK = SLURM_LOCALID
    LOCAL_WORLD_SIZE = SLURM_NTASKS_PER_NODE
    MASTER_ADDR = the allocation's first node (`scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1`)
    MASTER_PORT = 20000 + the job id mod 10000 (two stage jobs sharing a node meet on different ports)

Rank 0 writes to the job's output, <run>/logs/<name>.log, which `nebula site logs` reads; rank r > 0 to
<name>.rank<r>.log, as under the local supervisor. Jobs are named nebula.<site>.<service> and carry a
comment that names the site's run directory and the submission, so a job whose id was never recorded
(the supervisor died between sbatch and its write) is still found. nebula.site.slurm_jobs supervises.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nebula.errors import ConfigError, NebulaError
from nebula.site.scheduler import SchedulerConfig
from nebula.site.service import ServiceSpec

TIMEOUT_S = 30.0  # one Slurm command; a controller slower than this is asked again next round
# States of a job that may still run (squeue(1) "JOB STATE CODES"); every other state is an end.
LIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
                  "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})
# Reasons a job pends that no wait cures: the configuration asks for what this cluster will not give.
HOPELESS = ("account", "AccountNotAllowed", "InvalidAccount", "InvalidQOS", "QOSNotAllowed", "PartitionConfig",
            "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit")


class SlurmUnavailable(NebulaError):
    """A Slurm command failed or timed out (a busy or restarting controller): ask again later, conclude
    nothing about the jobs from it."""


@dataclass(frozen=True)
class JobState:
    job: str
    state: str  # RUNNING, COMPLETED, CANCELLED, ...; "UNKNOWN": no Slurm command knows the job any more
    reason: str = ""
    exit_code: int | None = None
    comment: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE


def run_key(run: Path) -> str:
    """What ties a job to one site's run directory (the comment's first word)."""
    return "nebula-" + hashlib.sha256(str(Path(run).resolve()).encode()).hexdigest()[:12]


def job_name(site: str, service: str) -> str:
    return f"nebula.{site}.{service}"


# -- the batch script -------------------------------------------------------------------------------------------
def sbatch_options(spec: ServiceSpec, scheduler: SchedulerConfig, site: str, gateway: bool = False) -> list[str]:
    """The #SBATCH lines of `spec`'s job: name, where its output goes, its tasks and what [scheduler] asks."""
    per_node = scheduler.ranks_per_node or spec.ranks
    if spec.ranks % per_node:
        raise ConfigError(f"[scheduler].ranks_per_node = {per_node} does not divide stage {spec.name}'s ranks = "
                          f"{spec.ranks}: every node runs as many ranks (change one of them)")
    options = [f"--job-name={job_name(site, spec.name)}", f"--output={spec.log}", "--open-mode=append",
               f"--nodes={spec.ranks // per_node}", f"--ntasks={spec.ranks}", f"--ntasks-per-node={per_node}",
               # Slurm's own requeue would run a second copy beside the one the supervisor resubmits
               "--no-requeue", f"--chdir={spec.cwd or spec.run}"]
    for key in ("partition", "account", "time"):
        if getattr(scheduler, key) is not None:
            options.append(f"--{key}={getattr(scheduler, key)}")
    if scheduler.gpus_per_rank:
        options.append(f"--gpus-per-task={scheduler.gpus_per_rank}")
    if gateway:
        options.append(f"--nodelist={scheduler.gateway_node}")
    return options + list(scheduler.sbatch)


def batch_script(spec: ServiceSpec, scheduler: SchedulerConfig, site: str, gateway: bool = False) -> str:
    """The job of `spec`: srun starts its ranks, each with torchrun's variables from Slurm's."""
    env = {**spec.env, "NEBULA_SERVICE": spec.name, "NEBULA_STATUS_FILE": str(spec.status_file),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as the local supervisor's environment
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(spec, scheduler, site, gateway)),
             f"# site {site}, service {spec.name}: written by `nebula site up` (docs/operate.md, \"A site on Slurm\")",
             "set -u",
             "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
             'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "export MASTER_ADDR MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) WORLD_SIZE=$SLURM_NTASKS",
             'echo "nebula: slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $SLURM_NTASKS rank(s), rendezvous '
             '$MASTER_ADDR:$MASTER_PORT"',
             f"exec srun --kill-on-bad-exit=1 --unbuffered bash -c {shlex.quote(rank_command(spec))} nebula-rank "
             + " ".join(map(shlex.quote, spec.argv))]
    return "\n".join(lines) + "\n"


def rank_command(spec: ServiceSpec) -> str:
    """What each srun task runs (`bash -c` with the service's argv after it): torchrun's per-rank variables
    from Slurm's, rank r > 0's output to <name>.rank<r>.log (rank 0's is the job's output)."""
    rank_log = shlex.quote(str(spec.rank_log(1)).removesuffix("1.log"))
    return ("export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; "
            f'[ "$RANK" = 0 ] || exec >>{rank_log}"$RANK.log" 2>&1; exec "$@"')


# -- the commands ------------------------------------------------------------------------------------------------
def command(*argv: str, timeout: float = TIMEOUT_S, input: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm command, its output as text; a ConfigError if Slurm is not installed here."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input,
                              env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except FileNotFoundError as exc:
        raise ConfigError(f"{argv[0]} is not on PATH: [scheduler] kind = \"slurm\" runs `site up` on a host of "
                          "the cluster with Slurm's commands (a login or edge node)") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnavailable(f"{' '.join(argv[:2])} did not answer within {timeout:.0f} s") from exc


def submit(script: Path, comment: str) -> str:
    """sbatch the script; -> the job id. A refusal is a ConfigError in sbatch's words."""
    done = command("sbatch", "--parsable", f"--comment={comment}", str(script))
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"


def test_only(script: Path) -> str | None:
    """sbatch --test-only: what sbatch says is wrong with the script without submitting it; None if nothing."""
    done = command("sbatch", "--test-only", str(script))
    return None if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip())


def queue(key: str, names: list[str]) -> dict[str, JobState]:
    """This site's jobs that the controller still holds (live, or ended within MinJobAge), by id."""
    done = command("squeue", "--noheader", "--states=all", f"--name={','.join(names)}", "--format=%i|%T|%k|%r")
    if done.returncode != 0:
        raise SlurmUnavailable(f"squeue: {done.stderr.strip()}")
    found = {}
    for line in done.stdout.splitlines():
        job, state, comment, reason = (line.split("|", 3) + ["", "", ""])[:4]
        if comment.split(" ")[0] == key:
            found[job] = JobState(job, state, reason=reason, comment=comment)
    return found


def ended(job: str) -> JobState:
    """How a job that left the queue (or ended in it) ended: sacct from the accounting storage, else from
    the job completion log (`sacct --completion`, a cluster without slurmdbd), else scontrol."""
    for argv in (("sacct", "--noheader", "--parsable2", "--allocations"), ("sacct", "--completion", "--noheader",
                                                                            "--parsable2")):
        done = command(*argv, f"--jobs={job}", "--format=JobID,State,ExitCode")
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            found, state, code = (line.split("|") + ["", ""])[:3]
            if found == job:
                return JobState(job, state.split(" ")[0], exit_code=_exit_code(code))
    done = command("scontrol", "--oneliner", "show", "job", job)
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f) if done.returncode == 0 else {}
    if "JobState" in fields:
        return JobState(job, fields["JobState"], reason=fields.get("Reason", ""),
                        exit_code=_exit_code(fields.get("ExitCode", "")))
    return JobState(job, "UNKNOWN")


def _exit_code(text: str) -> int | None:
    """sacct's "CODE:SIGNAL"; the job's exit status (a signal: 128 + it, as a shell says)."""
    try:
        code, signal = (int(x) for x in text.split(":"))
    except ValueError:
        return None
    return code or (128 + signal if signal else 0)


def cancel(jobs: list[str]) -> None:
    if jobs:
        done = command("scancel", *jobs)
        if done.returncode != 0 and "Invalid job id" not in done.stderr:  # one that ended meanwhile is fine
            raise SlurmUnavailable(f"scancel {' '.join(jobs)}: {done.stderr.strip()}")


# -- checks before anything is submitted --------------------------------------------------------------------------
def check_cluster(scheduler: SchedulerConfig, where: str) -> None:
    """The partition and account exist here and the account may use the partition: a ConfigError naming the
    key otherwise (a job that asks for them would pend forever, or be refused at the first resubmission)."""
    partitions = _partitions()
    if scheduler.partition is not None and scheduler.partition not in partitions:
        raise ConfigError(f"{where}.partition = {scheduler.partition!r}: this cluster has no such partition; it has "
                          f"{', '.join(sorted(partitions)) or 'none'} (`sinfo -s` lists them)")
    if scheduler.account is None:
        return
    if _accounting():
        done = command("sacctmgr", "--noheader", "--parsable2", "show", "associations",
                       f"account={scheduler.account}", "format=Account,User")
        if done.returncode == 0 and not done.stdout.strip():
            raise ConfigError(f"{where}.account = {scheduler.account!r}: the accounting database knows no such "
                              "account (`sacctmgr show accounts` lists them); ask the cluster's admin, or fix the name")
    part = partitions.get(scheduler.partition or _default(partitions) or "", {})
    allowed = part.get("AllowAccounts", "ALL")
    denied = part.get("DenyAccounts", "")
    if allowed != "ALL" and scheduler.account not in allowed.split(",") or scheduler.account in denied.split(","):
        raise ConfigError(f"{where}.account = {scheduler.account!r}: partition {part.get('PartitionName')} does not "
                          f"allow it (AllowAccounts={allowed}{', DenyAccounts=' + denied if denied else ''}); "
                          "name an account it allows, or another partition")


def _partitions() -> dict[str, dict[str, str]]:
    done = command("scontrol", "--oneliner", "show", "partition")
    if done.returncode != 0:
        raise ConfigError(f"the Slurm controller does not answer (`scontrol show partition`: {done.stderr.strip()}); "
                          "start it, or run `site up` where it is reachable")
    parts = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in done.stdout.splitlines()]
    return {p["PartitionName"]: p for p in parts if "PartitionName" in p}


def _default(partitions: dict[str, dict[str, str]]) -> str | None:
    return next((name for name, p in partitions.items() if p.get("Default") == "YES"), None)


def _accounting() -> bool:
    """Whether the cluster keeps accounts (slurmdbd): then sacctmgr knows which exist."""
    done = command("scontrol", "show", "config")
    return "accounting_storage/none" not in done.stdout and "AccountingStorageType" in done.stdout
