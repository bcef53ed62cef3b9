"""A submitted job's supervisor: `python -m nebula.site.job_supervisor DIR`, started detached by
`nebula job submit` (nebula.site.submit). It runs the job's stages at this site, each told on its
command line the job it runs for (`--job-id`, `--user`: the principal their data grants are checked
for), until they all end or SIGTERM comes (`nebula job stop`); then it records the end state and
revokes the job's certificates.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from nebula.security.accounts import SECRET_ENV
from nebula.security.grants import Principal
from nebula.security.job_record import record_file
from nebula.site.jobs import Site, finish
from nebula.site.process import ProcessId
from nebula.site.site import site_services
from nebula.site.supervisor import Supervisor, stop_signals


def run_job(directory: Path) -> int:
    """Supervise the job's stages until they all end or SIGTERM comes; record how it ended."""
    record = record_file(directory).read()
    site = Site.load(directory / "site.toml")
    principal = Principal(record["owner"], record["id"])
    # Not nebula.site.site.check_credentials: it would publish every site key into the job's directory.
    services = [s for s in site_services(site.config, site.path, principal=principal) if s.name != "gateway"]
    env = {**{k: v for k, v in os.environ.items() if k != SECRET_ENV}, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    supervisor = Supervisor(env=env, strict=False, state_file=directory / "status" / "supervisor.json")
    with stop_signals() as stopped:
        with record_file(directory).update() as entries:  # before any stage starts: `job stop` reaches it now
            entries.update(pid=os.getpid(), pid_start=ProcessId.mine().started)
        state, why = "failed", "the supervisor failed"
        try:
            for spec in services:
                supervisor.start(spec)
            with record_file(directory).update() as entries:
                entries["state"] = "running"
            print(f"job {record['id']}: {', '.join(s.name for s in services)} started", flush=True)
            supervisor.run(lambda: bool(stopped) or all(s.state in ("done", "failed")
                                                        for s in supervisor.services.values()))
            failed = [s.name for s in supervisor.services.values() if s.state == "failed"]
            state, why = (("stopped", "stopped by its owner") if stopped else
                          ("failed", f"stage(s) {', '.join(failed)} failed") if failed else
                          ("done", "every stage finished"))
        finally:
            supervisor.stop()
            finish(site, directory, state, why)
            print(f"job {record['id']}: {state} ({why})", flush=True)
    return 0 if state != "failed" else 1


def main() -> int:
    return run_job(Path(sys.argv[1]).resolve())


if __name__ == "__main__":
    sys.exit(main())
