"""A site's services as Slurm jobs ([scheduler] kind = "slurm"): submitted by `nebula site up`'s
supervisor, watched through the scheduler, resubmitted with backoff when one fails, is preempted, runs
out of time or is cancelled by someone else, and cancelled by `site down`.

    jobs = SlurmJobs(site, specs)       # writes the ledger, every service "new"
    jobs.start(spec)                    # sbatch; each round of the supervisor's loop: jobs.poll()
    jobs.stop(timeout)                  # scancel, and wait until the controller holds none of them live

The ledger, <run>/slurm/jobs.json, is written atomically before each sbatch (the submission without
its id) and after it (with the id), and whenever a job changes state: a job is never submitted without
a record, and a record without an id (the supervisor died inside sbatch) is matched to its job by the
comment every job carries (nebula.site.slurm). `site status` and `site down` read the ledger and ask the
scheduler, so a job whose supervisor died is still shown, and still cancelled.

A resubmitted stage starts `nebula stage run` again, which resumes from the newest checkpoint every
stage of the job holds (the runtime's coordinator): each step is applied once. Exit code 3
(nebula.errors.EXIT_FIX_FIRST: bad configuration, bad data) is never resubmitted, as locally.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nebula.errors import EXIT_FIX_FIRST, ConfigError
from nebula.security.keyfile import write_atomic
from nebula.site import slurm
from nebula.site.config import SiteConfig
from nebula.site.pidfile import read_json_or_empty
from nebula.site.service import ServiceSpec, tail
from nebula.site.supervisor import STABLE_S

BACKOFF_FIRST, BACKOFF_MAX = 2.0, 120.0  # seconds before a resubmission: 2, 4, 8, ... 120
ACTIVE = ("new", "submitting", "submitted", "pending", "running")  # its job is (or may be) the scheduler's


def ledger_file(site: SiteConfig) -> Path:
    return site.run / "slurm" / "jobs.json"


def scheduled(site: SiteConfig, spec: ServiceSpec) -> bool:
    """Whether `site up` runs `spec` as a Slurm job: every stage, and the gateway with gateway = "job"."""
    return site.scheduler.slurm and (spec.name != "gateway" or site.scheduler.gateway == "job")


class SlurmJobs:
    def __init__(self, site: SiteConfig, specs: list[ServiceSpec]):
        self.site, self.key = site, slurm.run_key(site.run)
        self.specs = {s.name: s for s in specs}
        self.jobs: dict[str, dict[str, Any]] = {s.name: {
            "name": s.name, "state": "new", "job": None, "slurm_state": None, "reason": "", "ranks": s.ranks,
            "log": str(s.log), "resubmits": 0, "streak": 0, "retry_at": None, "running_since": None,
            "exit_code": None, "submissions": []} for s in specs}
        self.last_poll = 0.0
        self.save()

    # -- submitting ------------------------------------------------------------------------------------------------
    def start(self, spec: ServiceSpec) -> None:
        script = self.site.run / "slurm" / f"{spec.name}.sbatch"
        write_atomic(script, batch(self.site, spec).encode())
        self._submit(self.jobs[spec.name])

    def finished(self, spec: ServiceSpec) -> None:
        """Record `spec` as done without submitting it (its stage finished the job before this start)."""
        self.jobs[spec.name].update(state="done", exit_code=0)
        self.save()

    def _submit(self, entry: dict) -> None:
        script = self.site.run / "slurm" / f"{entry['name']}.sbatch"
        comment = f"{self.key} {entry['name']}.{len(entry['submissions'])}"
        submission = {"job": None, "comment": comment, "submitted": time.time(), "state": None, "exit_code": None}
        entry["submissions"].append(submission)
        self.save()  # before sbatch: a job is never without its record
        try:
            self._submitted(entry, slurm.submit(script, comment))
        except ConfigError as exc:
            entry.update(state="failed", why=str(exc))
            self._say(f"{entry['name']} not submitted: {exc}")
        except slurm.SlurmUnavailable as exc:  # sbatch may have submitted it all the same: its comment tells
            entry["state"] = "submitting"
            self._say(f"{entry['name']}: sbatch did not answer ({exc}); looking for the job by its comment")
        self.save()

    def _submitted(self, entry: dict, job: str) -> None:
        entry["submissions"][-1]["job"] = job
        entry.update(state="submitted", job=job, slurm_state="PENDING", running_since=None)
        self._say(f"{entry['name']} submitted as slurm job {job}")

    def _find(self, entry: dict) -> None:
        """A submission sbatch did not confirm: the job with its comment is adopted; if the controller knows
        none, it is submitted again; if the controller does not answer, asked again next round."""
        comment = entry["submissions"][-1]["comment"]
        try:
            found = slurm.queue(self.key, [slurm.job_name(self.site.name, entry["name"])])
        except slurm.SlurmUnavailable:
            return
        job = next((j for j, seen in found.items() if seen.comment == comment), None)
        if job is not None:
            self._submitted(entry, job)
        else:
            entry["submissions"][-1]["state"] = "NOT_SUBMITTED"
            self._submit(entry)

    # -- watching --------------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """One round: resubmit what waited out its backoff; every `poll` s, ask the scheduler about the others."""
        for entry in self.jobs.values():
            if entry["state"] == "backoff" and time.time() >= entry["retry_at"]:
                entry["resubmits"] += 1
                self._submit(entry)
        if time.monotonic() - self.last_poll < self.site.scheduler.poll:
            return
        self.last_poll = time.monotonic()
        for entry in [e for e in self.jobs.values() if e["state"] == "submitting"]:
            self._find(entry)
        watched = [e for e in self.jobs.values() if e["state"] in ACTIVE and e["job"] is not None]
        if not watched:
            return
        try:
            queued = slurm.queue(self.key, [slurm.job_name(self.site.name, e["name"]) for e in watched])
            for entry in watched:
                self._update(entry, queued.get(entry["job"]))
        except slurm.SlurmUnavailable as exc:  # nothing is concluded from a controller that did not answer
            self._say(f"the scheduler did not answer ({exc}); asking again in {self.site.scheduler.poll:.0f} s")
        self.save()

    def _update(self, entry: dict, seen: slurm.JobState | None) -> None:
        if seen is None:  # not in squeue's answer: how it ended, or (a controller catching up) that it still runs
            seen = slurm.ended(entry["job"])
        if seen.live:
            entry.update(slurm_state=seen.state, reason=seen.reason)
            if seen.state == "PENDING" and any(h.lower() in seen.reason.lower() for h in slurm.HOPELESS):
                slurm.cancel([entry["job"]])
                self._end(entry, slurm.JobState(seen.job, "CANCELLED"), f"it can never start here: {seen.reason}")
            elif seen.state == "RUNNING" and entry["state"] != "running":
                entry.update(state="running", running_since=time.time())
            elif seen.state == "PENDING":
                entry["state"] = "pending"
            return
        end = seen if seen.exit_code is not None else slurm.ended(entry["job"])  # squeue shows no exit code
        self._end(entry, seen if end.state == "UNKNOWN" else end)

    def _end(self, entry: dict, end: slurm.JobState, why: str | None = None) -> None:
        """What follows a job's end: done, a resubmission after backoff, or failed for good; then the ledger."""
        self._next(entry, end, why)
        self.save()

    def _next(self, entry: dict, end: slurm.JobState, why: str | None) -> None:
        entry["submissions"][-1].update(state=end.state, exit_code=end.exit_code, ended=time.time())
        entry.update(slurm_state=end.state, exit_code=end.exit_code, reason=end.reason)
        what = f"{entry['name']}'s slurm job {entry['job']} ended {end.state} (exit code {end.exit_code})"
        if end.state == "COMPLETED" and end.exit_code == 0:
            entry["state"] = "done"
            self._say(what)
            return
        if entry["running_since"] is not None and time.time() - entry["running_since"] >= STABLE_S:
            entry["streak"] = 0  # it had recovered: a new incident, not the next of a series
        if why is None and end.exit_code != EXIT_FIX_FIRST and entry["streak"] < self.site.scheduler.max_resubmits:
            delay = min(BACKOFF_FIRST * 2 ** entry["streak"], BACKOFF_MAX)
            entry.update(state="backoff", retry_at=time.time() + delay, streak=entry["streak"] + 1)
            self._say(f"{what}; resubmitting in {delay:.0f} s ({entry['streak']} of at most "
                      f"{self.site.scheduler.max_resubmits} in a row), to resume from its checkpoint")
            return
        reason = why or ("a fix is needed first (exit 3), not resubmitted" if end.exit_code == EXIT_FIX_FIRST
                         else f"resubmitted {entry['streak']} times in a row already ([scheduler].max_resubmits)")
        entry.update(state="failed", why=reason)
        self._say(f"{what}: {reason}; last lines of {entry['log']}:\n{tail(Path(entry['log']), 15)}")

    # -- stopping --------------------------------------------------------------------------------------------------
    def stop(self, timeout: float = 60.0) -> list[str]:
        """scancel every job of the site and wait (up to `timeout` s) until the controller holds none live."""
        stopped = cancel_jobs(self.site, timeout, names=list(self.jobs))
        for entry in self.jobs.values():
            if entry["state"] in (*ACTIVE, "backoff"):
                entry["state"] = "stopped"
                if entry["job"] is not None and entry["submissions"][-1]["state"] is None:
                    entry["submissions"][-1].update(state="CANCELLED", ended=time.time())
        self.save()
        return stopped

    def save(self) -> None:
        state = {"site": self.site.name, "key": self.key, "updated": time.time(), "services": list(self.jobs.values())}
        write_atomic(ledger_file(self.site), (json.dumps(state, indent=1) + "\n").encode())

    def _say(self, text: str) -> None:
        print(f"site {self.site.name}: {text}", flush=True)


def batch(site: SiteConfig, spec: ServiceSpec) -> str:
    return slurm.batch_script(spec, site.scheduler, site.name, gateway=spec.name == "gateway")


# -- what `site status`, `site down` and `site up` read ------------------------------------------------------------
def recorded(site: SiteConfig) -> list[dict]:
    """The ledger's services, as the last supervisor left them."""
    return read_json_or_empty(ledger_file(site)).get("services", []) if site.scheduler.slurm else []


def live_jobs(site: SiteConfig, names: list[str] | None = None) -> dict[str, slurm.JobState]:
    """The site's jobs the controller holds live, by id: the ledger's and any with the site's comment (one
    whose id was never written), found by their names."""
    names = names if names is not None else [s["name"] for s in recorded(site)]
    if not names:
        return {}
    found = slurm.queue(slurm.run_key(site.run), [slurm.job_name(site.name, n) for n in names])
    return {job: s for job, s in found.items() if s.live}


def cancel_jobs(site: SiteConfig, timeout: float, names: list[str] | None = None) -> list[str]:
    """scancel the site's live jobs; back once none is live or `timeout` passed. -> one line per job."""
    try:
        live = live_jobs(site, names)
        slurm.cancel(sorted(live))
        deadline = time.monotonic() + timeout
        while (left := live_jobs(site, names)) and time.monotonic() < deadline:
            time.sleep(0.5)
    except slurm.SlurmUnavailable as exc:
        return [f"slurm jobs not cancelled: {exc}; cancel them with `scancel --name nebula.{site.name}.NAME`"]
    return [f"cancelled slurm job {job} ({s.comment.split(' ')[-1]})" + (", still ending" if job in left else "")
            for job, s in sorted(live.items())]


def scheduled_status(site: SiteConfig, supervised: bool) -> list[dict]:
    """`site status`'s rows of the site's jobs: the ledger's states, the scheduler's where no supervisor runs."""
    records = recorded(site)
    try:
        live = live_jobs(site) if records and not supervised else {}
    except slurm.SlurmUnavailable:
        live = {}
    rows = []
    for r in records:
        state = r["state"] if supervised or r["state"] in ("done", "failed", "stopped") else \
            "orphaned" if r["job"] in live else "down"
        started = r["running_since"] or (r["submissions"][-1]["submitted"] if r["submissions"] else 0)
        rows.append({"name": r["name"], "state": state, "pid": None, "pids": [], "started": started,
                     "restarts": r["resubmits"], "exit_code": r["exit_code"],
            "log": r["log"], "slurm_job": r["job"], "slurm_state": live[r["job"]].state if r["job"] in live
            else r["slurm_state"]})
    return rows


def check(site: SiteConfig, specs: list[ServiceSpec]) -> None:
    """Before `site up` starts anything: the cluster has the partition and account, and sbatch accepts each
    job's script (`sbatch --test-only`); a ConfigError naming the key otherwise."""
    where = f"{site.source} [scheduler]"
    slurm.check_cluster(site.scheduler, where)
    scripts = site.run / "slurm"
    scripts.mkdir(parents=True, exist_ok=True)
    for spec in (s for s in specs if scheduled(site, s)):
        path = scripts / f"{spec.name}.sbatch"
        write_atomic(path, batch(site, spec).encode())
        refused = slurm.test_only(path)
        if refused is not None:
            raise ConfigError(f"{where}: sbatch refuses {spec.name}'s job ({refused}); {_key(refused)}")


def _key(refused: str) -> str:
    """The [scheduler] key an sbatch refusal points at."""
    lower = refused.lower()
    for words, key in ((("partition",), "partition"), (("account",), "account"), (("time",), "time"),
                       (("gres", "gpu"), "gpus_per_rank"), (("node",), "ranks_per_node or gateway_node")):
        if any(w in lower for w in words):
            return f"check [scheduler].{key}"
    return "check [scheduler].sbatch, the extra options"
