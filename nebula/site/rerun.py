"""`nebula site up CONFIG --new-run`: the site's job again from its first step, after the job changed (a new
run, or the same job with a stage swapped), in one command per site and with nothing deleted.

A stage resumes from the newest checkpoint every stage holds, and one that ran the job to its end is not
started again; both are right for a restart and wrong for a changed job (a swapped stage's new weights
do not fit its old checkpoints; a finished peer never answers). So the site's own services are stopped if
they run (users' jobs are left alone), and each of this site's stages' workdirs (checkpoints, ledger,
metrics, finished.json) moves aside to <run>/previous/<UTC time>/<stage>; `site up` then starts them as
new. Every site of the job runs it, so that all stages start at step 0 together.
"""
from __future__ import annotations

import time
from pathlib import Path

from nebula.site.config import SiteConfig
from nebula.site.control import site_groups, take_down
from nebula.site.site import site_services


def new_run(site: SiteConfig, config: Path, only: str | None = None, timeout: float = 20.0) -> list[str]:
    """Stop the site's own services if they run, move its stages' workdirs aside (or stage `only`'s);
    -> a line for each thing done."""
    lines = []
    if any(group.job is None for group in site_groups(site)):
        lines += take_down(site, timeout, jobs=False)
    stamp = time.strftime("%Y%m%d-%H%M%SZ", time.gmtime())
    stages = [s.name for s in site_services(site, config, only) if s.name != "gateway"]
    for name in stages:
        workdir = site.run / name
        if workdir.exists():
            kept = site.run / "previous" / stamp / name
            kept.parent.mkdir(parents=True, exist_ok=True)
            workdir.rename(kept)
            lines.append(f"{name}: the previous run's workdir is now {kept}")
    if not lines:
        lines.append(f"site {site.name}: no earlier run of {', '.join(stages) or 'its stages'} to move aside")
    return lines
