"""A changed job run again at sites started with `site init --job` + `site up` (issue 52, point 6): one command
per site, `nebula site up CONFIG --new-run`, and no workdir deleted by hand. The job first runs to its end at
both sites; then its sink's implementation is swapped for one with other weights (whose old checkpoints
cannot load) and each site runs the one command: both stages train the new job from step 0 to its end,
the previous run's workdirs kept under run/previous/. Real processes, real CURVE."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nebula.runtime.job_file import write_job_file
from tests.integration.test_site_operation import init, nebula, status, trust
from tests.support.gateways import wait_for

STEPS = 4


def job_table(sink_impl: str) -> dict:
    return {"job": {"name": "swap"},
            "train": {"steps": STEPS, "batch_size": 8, "micro_batches": 2, "checkpoint_every": 2, "log_every": 1},
            "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                       "sink": {"address": "b/sink/0", "impl": sink_impl}},
            "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]}


def finished(config: Path, stage: str) -> bool:
    return {s["service"]: s["state"] for s in status(config)["services"]}.get(stage) == "done"


@pytest.mark.slow  # two sites, each up twice: ~1 min idle, 2 on busy cores
def test_a_changed_job_runs_again_with_one_command_per_site(tmp_path):
    job = tmp_path / "job.toml"
    write_job_file(job, job_table("example-sink"))
    a, to_a = init(tmp_path, "a", job)
    b, to_b = init(tmp_path, "b", job)
    trust(a, to_b)
    trust(b, to_a)
    try:
        for config in (a, b):
            nebula("site", "up", config)
        wait_for(lambda: finished(a, "src") and finished(b, "sink"), timeout=120, what="the first run to end")
        write_job_file(job, job_table("tests.support.runtime:NormedSink"))  # the sink swapped: other weights
        for config in (a, b):
            out = nebula("site", "up", config, "--new-run").stdout
            assert "the previous run's workdir is now" in out and "stopped site" in out, out
        wait_for(lambda: finished(a, "src") and finished(b, "sink"), timeout=120, what="the new run to end")
    finally:
        for config in (a, b):
            nebula("site", "down", config, check=False)
    for config, stage in ((a, "src"), (b, "sink")):
        run = config.parent / "run"
        ledger = json.loads((run / stage / "ledger.json").read_text())["steps"]
        assert [step for step, _ in ledger] == list(range(1, STEPS + 1)), stage  # the new run, once each
        previous = list((run / "previous").glob(f"*/{stage}"))
        assert len(previous) == 1 and (previous[0] / "finished.json").exists()  # the first run, kept whole
    weights = torch.load(b.parent / "run" / "sink" / "checkpoints" / f"step-{STEPS:08d}.pt", weights_only=False)
    assert {"0.weight", "1.weight"} <= set(weights["stage"]["weights"])  # NormedSink's BatchNorm and Linear
