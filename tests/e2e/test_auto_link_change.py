"""`compression = "auto"` re-decides when the emulated link's rate changes under a running job (issue 15,
item 3): real processes, gateways and CURVE in two namespaces joined by a tbf-shaped link whose rate
WanLink.set_rate changes mid-run. The measured run at the paper's shape is `nebula bench wan --auto
--change` (docs/bench-wan.md)."""
from __future__ import annotations

import os
import time

import pytest

from nebula.codecs.auto import LADDER
from nebula.runtime.job_file import write_job_file
from nebula.runtime.metrics import read_records
from nebula.site.local import start_sites
from nebula_lab.bench.wan_change import SLOWER_WITHIN
from nebula_lab.wanem import WanLink
from tests.support.wan import ROOT

FAST, SLOW = 80.0, 2.0  # Mbit/s: 256 kB a step each way is 26 ms of wire, then 1.0 s, against 0.2 s of compute
DROP, RISE, STEPS = 12, 26, 56  # the link slows once the sink has done DROP steps, recovers at RISE
RECOVERED_BY = STEPS - 4  # ... and is lossless again in both directions from this step on


def paced_job(path) -> None:
    """The example workload, width 4096 (a (4, 4096) float32 micro-batch: 64 kB), both stages paced to
    0.05 s a micro-batch, `auto` both ways."""
    stage = {"width": 4096, "examples": 256}
    write_job_file(path, {
        "job": {"name": "auto-change"},
        "train": {"steps": STEPS, "batch_size": 16, "micro_batches": 4, "checkpoint_every": STEPS, "log_every": 100,
                  "seed": 1},
        "schedule": {"name": "synchronous"},
        "stages": {"src": {"address": "a/src/0", "impl": "tests.support.runtime:PacedSource", **stage},
                   "sink": {"address": "b/sink/0", "impl": "tests.support.runtime:PacedSink", **stage}},
        "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True, "compression": "auto"}]})


def done(run) -> int:
    steps = read_records(run / "sink" / "metrics.jsonl")
    return steps[-1]["step"] if steps else 0


@pytest.mark.root
@ROOT
@pytest.mark.timeout(240)
def test_auto_goes_lossy_within_a_bounded_number_of_steps_when_the_link_slows_and_back_when_it_recovers(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    paced_job(run / "job.toml")
    changes = {}
    with WanLink(f"nbac{os.getpid()}", rate_mbit=FAST) as link:
        group = start_sites(run, run / "job.toml", wan=link, restart=False)
        try:
            deadline = time.monotonic() + 180
            while not all(group.services[name].finished() for name in ("src", "sink")):
                group.poll()  # raises StageError, with the log tail, if a stage failed
                assert time.monotonic() < deadline, "the job did not finish in 180 s"
                for at, rate in ((DROP, SLOW), (RISE, FAST)):
                    if at not in changes and done(run) >= at:
                        link.set_rate(rate)
                        changes[at] = done(run)
                time.sleep(0.1)
        finally:
            group.stop()
    events = {d: [e for e in read_records(run / stage / "metrics.jsonl", kind="event") if e["event"] == "compression"]
              for stage, d in (("src", "forward"), ("sink", "backward"))}
    for direction, moves in events.items():
        assert all(e["dir"] == direction for e in moves)
        assert not [e for e in moves if e["step"] <= changes[DROP]], f"{direction}: lossy at {FAST} Mbit/s: {moves}"
        slowed = [e for e in moves if changes[DROP] < e["step"] <= changes[RISE]]
        assert slowed and slowed[0]["step"] <= changes[DROP] + SLOWER_WITHIN + 1, (direction, changes, moves)
        # 1.0 s of uncompressed wire a step against a budget of 0.4 x 0.2 s: no rung before int8(lowrank(0.5)) fits
        assert LADDER.index(slowed[-1]["new"]) >= LADDER.index("int8(lowrank(0.5))"), slowed
        assert moves[-1]["new"] == "none" and moves[-1]["step"] <= RECOVERED_BY, (direction, changes, moves)
    for stage, direction in (("src", "forward"), ("sink", "backward")):
        used = {r["codec"] for r in read_records(run / stage / "link.jsonl", kind=None)
                if r.get("auto") and r.get("dir") == direction and r["step"] > RECOVERED_BY}
        assert used == {"none"}, (direction, used)
