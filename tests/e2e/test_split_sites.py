"""Split jobs (issue 52) as real services: a gateway per site, CURVE on every socket, each stage its own
process. Both families train across sites and evaluate through every hop; a split stage killed mid-run
resumes, every step applied once and the loss the undisturbed run's; and the shipped GPT-2 small (2 and 4
sites) and MiniLM jobs split to the unsplit models on tiny copies of their data."""
import json
from pathlib import Path

import pytest

from nebula.runtime.job import load_job
from nebula.runtime.job_file import override, read_job_table, write_job_file
from nebula.runtime.order import ExampleOrder, digest, id_hash
from nebula.shipped import shipped_jobs
from nebula_lab.bench import chaos
from services.split.bench import portable
from services.split.verify import verify
from tests.support.gpt import tiny_corpus
from tests.support.sites import records
from tests.support.split import bert_job, gpt2_job, pairs_data


def ledger_of(job) -> list[list]:
    """What each step must have trained on: the example order over the first stage's examples."""
    from services.split.data import open_examples

    options = job.stage("p0").options
    ids = open_examples(options.data, Path(job.data), None, Path(job.data)).ids["train"]
    hashes = [id_hash(i) for i in ids]
    order = ExampleOrder(len(ids), job.train.batch_size, job.train.seed)
    return [[s, digest([hashes[i] for i in order.indices(s)])] for s in range(1, job.train.steps + 1)]


def moved(source: Path, target: Path, **train) -> Path:
    """The job at `source`, its model files made absolute, written to `target` (with [train] keys set)."""
    table = portable(read_job_table(source), source)
    write_job_file(target, override(table, train=train) if train else table)
    return target


@pytest.mark.slow  # five processes of transformers models start on 2 cores: ~2 min
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_both_families_train_across_sites_and_evaluate_through_every_hop(tmp_path, start_job, family):
    if family == "gpt2":
        path = gpt2_job(tmp_path / "src", ["transformer.h.1", "transformer.h.3"], steps=8,
                        compression={"forward": "bf16", "backward": "bf16"}, stage={"eval_examples": 8})
    else:
        path = bert_job(tmp_path / "src", ["bert.encoder.layer.2"], steps=8, stage={"eval_examples": 8})
    sites = start_job(moved(path, tmp_path / "job.toml"))
    sites.wait(timeout=600)
    sites.stop()
    for stage in sites.stages:  # every step once, in order, on the examples of the order
        assert sites.ledger(stage) == ledger_of(sites.job), stage
    last = list(sites.stages)[-1]
    losses = [r["loss"] for r in records(sites.run / last / "metrics.jsonl", "step")]
    assert len(losses) == 8 and all(loss > 0 for loss in losses)
    scores = json.loads((sites.run / "p0" / "scores-valid.json").read_text())
    assert scores["n"] == 8 and scores["loss"] > 0 and "accuracy" in scores
    sent = {k for r in records(sites.run / "p1" / "metrics.jsonl", "step") for k in r["bytes_per_token"]}
    assert {"p0->p1:backward"} <= sent  # gradients went back from part 1 to part 0 over the WAN path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_split_stage_killed_mid_run_resumes_with_every_step_applied_once(tmp_path):
    source = gpt2_job(tmp_path / "src", ["transformer.h.1", "transformer.h.3"])
    portable_job = moved(source, tmp_path / "portable.toml")
    job = chaos.prepare_job(portable_job, tmp_path / "seed-2", steps=12, checkpoint_every=2, seed=2)
    row = chaos.run_kills(job, tmp_path / "seed-2", seed=2, kills=3)
    chaos.print_row(row)
    assert row["kills"] == 3 and row["restarts"] >= 3, row
    assert row["ok"], row["problems"]
    assert row["losses"]["p2"]["max_step_diff"] == 0.0  # no dropout: a resume is exact
    loaded = load_job(job)
    for stage in loaded.stages:
        assert chaos.ledger(tmp_path / "seed-2" / "chaos", stage) == ledger_of(loaded), stage


@pytest.mark.slow  # GPT-2 small and MiniLM, each stage built and traced: ~3 min idle
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["gpt2-2site", "gpt2-4site", "minilm-pairs-2site"])
def test_the_shipped_jobs_split_to_their_unsplit_models(tmp_path, name):
    """The real models of the shipped jobs (GPT-2 small at the project's vocabulary, MiniLM's pre-trained
    weights), on tiny copies of their data: `nebula split verify`'s check."""
    data = pairs_data(tmp_path / "data") if name.startswith("minilm") else tiny_corpus(tmp_path / "data")
    if name.startswith("minilm"):
        (data / "test.jsonl").write_text((data / "valid.jsonl").read_text())
    table = portable(read_job_table(shipped_jobs()[name]), shipped_jobs()[name])
    path = tmp_path / f"{name}.toml"
    write_job_file(path, override(table, job={"data": str(data)}))
    result = verify(load_job(path))
    print(json.dumps({k: v for k, v in result.items() if k != "parts"}))
    assert result["ok"] and result["loss_diff"] <= 1e-5 and result["max_rel_grad_diff"] <= 1e-4, result
