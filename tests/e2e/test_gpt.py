"""The GPT workload keeps the runtime's guarantees (issue 43): a tiny GPT split over three sites, run as
real services (gateways, CURVE, supervisors) through `nebula bench chaos`'s functions, with kills of any
service: every stage applies every step of the example order once, and the final loss is the
undisturbed run's."""
from pathlib import Path

import numpy as np
import pytest

from nebula.runtime.job import JobConfig, load_job
from nebula.runtime.order import ExampleOrder, digest, id_hash
from nebula_lab.bench import chaos
from tests.support.gpt import gpt_job
from tests.support.wan import ROOT


def gpt_ledger(job: JobConfig) -> list[list]:
    """What each step must have trained on: the example order over the corpus's windows."""
    seq_len = job.stage("first").options.seq_len
    windows = (len(np.fromfile(Path(job.data) / "train.tokens", dtype="<u2")) - 1) // seq_len
    hashes = [id_hash(f"train:{i}") for i in range(windows)]
    order = ExampleOrder(windows, job.train.batch_size, job.train.seed)
    return [[s, digest([hashes[i] for i in order.indices(s)])] for s in range(1, job.train.steps + 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kills_of_any_service_of_a_three_site_gpt_leave_every_step_applied_once(tmp_path):
    source = gpt_job(tmp_path / "source", bottleneck=4, compression={"forward": "int8", "backward": "int8"})
    job = chaos.prepare_job(source, tmp_path / "seed-2", steps=16, checkpoint_every=2, seed=2)
    row = chaos.run_kills(job, tmp_path / "seed-2", seed=2, kills=3)
    chaos.print_row(row)
    assert row["kills"] == 3 and row["restarts"] >= 3, row
    assert row["ok"], row["problems"]
    assert row["losses"]["last"]["diff"] <= row["losses"]["last"]["noise"], row["losses"]
    assert row["losses"]["last"]["max_step_diff"] == 0.0  # no dropout: a resume is exact
    loaded = load_job(job)
    for stage in loaded.stages:
        assert chaos.ledger(tmp_path / "seed-2" / "chaos", stage) == gpt_ledger(loaded), stage


@pytest.mark.root
@ROOT
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_30_s_wan_cut_of_a_two_site_gpt_is_ridden_out(tmp_path):
    """The link between the two halves is cut for 30 s mid-job: the same processes carry on once it is
    back, nothing restarts or resumes, every step applied once, the loss as undisturbed."""
    halves = (("first", "gpt-first", [0, 2]), ("last", "gpt-last", [2, 4]))
    source = gpt_job(tmp_path / "source", halves, bottleneck=4, compression={"forward": "int4", "backward": "int8"})
    job = chaos.prepare_job(source, tmp_path / "seed-1", steps=12, checkpoint_every=2, seed=1)
    row = chaos.run_cut(job, tmp_path / "seed-1", 30, at_step=3)
    chaos.print_row(row)
    assert row["stopped"] is None and row["restarts"] == 0 and row["resumed_from"] == [], row
    assert row["ok"], row["problems"]
    assert row["losses"]["last"]["max_step_diff"] == 0.0, row["losses"]
    loaded = load_job(job)
    for stage in loaded.stages:
        assert chaos.ledger(tmp_path / "seed-1" / "cut", stage) == gpt_ledger(loaded), stage
