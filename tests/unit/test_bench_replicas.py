"""The replicas bench's parts (nebula_lab.bench.replicas, replicas_runs, ddp_peer) on a tiny GPT: the DDP peer
is data parallelism over the replicas' shards (its weights equal one process training on their union, the
global batch), Nebula's replicas at H = 1 averaging every step stay near it, and the table judges the
targets as the issue states them."""
import argparse
import json

import pytest
import torch

from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from nebula.runtime.order import ExampleOrder
from nebula.runtime.service import build_stage
from nebula_lab.bench.ddp_peer import run_ranks
from nebula_lab.bench.replicas import SETTINGS, Plan, verdicts
from nebula_lab.bench.replicas_runs import curve, last_evaluated, same_job, write
from services.gpt.bench import SCENARIO as GPT
from services.gpt.model import lm_loss
from tests.support.gpt import TINY, tiny_corpus


def tiny_replicas(root, steps=4, replicas=2, **table):
    data = tiny_corpus(root / "data")
    stage = {"address": "a/whole/0", "impl": "gpt-whole", "layers": [0, 4], "device": "cpu", "threads": 1,
             "eval_examples": 8, **TINY}
    return {"job": {"name": "tiny-replicas", "data": str(data)},
            "train": {"steps": steps, "batch_size": 4, "micro_batches": 2, "checkpoint_every": 2, "seed": 1},
            "stages": {"whole": stage},
            "replicas": {"groups": [[s] for s in "abcd"[:replicas]], "H": 1, "deadline_s": 60, **table}}


def global_batch_reference(job_file, steps):
    """One process, one optimiser, every step on the union of the replicas' batches (DDP's mean gradient)."""
    job = load_job(job_file)
    count = job.replicas.count
    stage = build_stage(job.replica_view(0), "whole", job_file.parent / "reference", quiet=True)
    orders = [ExampleOrder(len(stage.examples("train")), job.train.batch_size, job.train.seed, (k, count))
              for k in range(count)]
    m = job.train.micro_batches
    for t in range(1, steps + 1):
        for order in orders:
            indices = order.indices(t)
            for k in range(m):
                inputs, targets = stage.data.windows("train", indices[k::m])
                (lm_loss(stage.module(inputs), targets) / (m * count)).backward()
        stage.optimizer.step()
        stage.scheduler.step()
        stage.optimizer.zero_grad(set_to_none=True)
    return stage


@pytest.mark.slow  # two torch processes and a reference: ~1 min on two busy cores
def test_the_ddp_peer_equals_one_process_on_the_global_batch(tmp_path):
    job_file = write(tmp_path / "ddp", tiny_replicas(tmp_path, steps=3))
    run_ranks(tmp_path / "ddp", job_file, "gpt", 2, 3, eval_every=3, timeout_s=600)
    want = global_batch_reference(job_file, 3)
    assert "step 3/3: validation loss" in (tmp_path / "ddp" / "rank0.log").read_text()  # progress, as it goes
    got = torch.load(tmp_path / "ddp" / "rank0" / "weights.pt")
    for name, value in want.trainable().items():
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    evaluated = [json.loads(line) for line in (tmp_path / "ddp" / "rank0" / "valid.jsonl").read_text().splitlines()]
    assert evaluated[0]["step"] == 3
    assert evaluated[0]["loss"] == pytest.approx(GPT.peer_eval(want, want.module), rel=1e-4)


@pytest.mark.slow
def test_replicas_at_h1_stay_near_ddp_and_score_as_its_peer_does(tmp_path, capsys):
    raw = tiny_replicas(tmp_path, steps=4, outer={"lr": 1.0, "momentum": 0.0})
    nebula = curve(tmp_path / "nebula", raw, "nebula", 2, "gpt")
    ddp = curve(tmp_path / "ddp", raw, "ddp", 2, "gpt")
    said = capsys.readouterr().err  # a long curve says where it is
    assert "nebula: training 4 steps" in said and "nebula: step 2/4, validation loss" in said
    assert f"ddp: training 4 steps, each evaluation in {tmp_path / 'ddp' / 'rank0.log'}" in said
    assert [s for s, _ in nebula] == [s for s, _ in ddp] == [2, 4]
    for (_, ours), (_, theirs) in zip(nebula, ddp):
        assert ours == pytest.approx(theirs, rel=0.02)  # averaging weights after AdamW, not its gradients


def args(**given):
    base = dict(quick=True, replicas=None, settings=None, workload=None, kill=None, peer="ddp", seeds=None,
                job=None, max_steps=None, eval_every=25, time_to_loss=None, steps=None, rtt_ms=None,
                bound_factor=5.0, workdir=None, json=False, H=None, steps_only=False,
                lr_schedule=None, warm_start=None)
    return argparse.Namespace(**{**base, **given})


def test_the_plan_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="--settings: fast unknown"):
        Plan(args(settings=["chosen", "fast"]))
    with pytest.raises(ConfigError, match="a multiple of every setting's H"):
        Plan(args(eval_every=15))
    assert [s.name for s in Plan(args(peer=None)).settings] == ["h1", "chosen"]  # the peer only when asked for
    plan = Plan(args())
    assert plan.every == 10 and plan.target == 7.3 and plan.counts == [2]
    job = plan.job(plan.settings[-1], 4, 3, 20)
    assert job["replicas"]["groups"] == [["a"], ["b"], ["c"], ["d"]] and job["train"]["seed"] == 3
    assert job["replicas"]["codec"] == "int4" and job["replicas"]["H"] == 10


def row(setting, **values):
    return {"setting": setting, "replicas": 2, "target": 6.5, "seeds": [1, 2, 3], "wan_bytes_per_step": None,
            "val_loss": None, "T_s": None, **values}


def test_the_verdicts_judge_the_targets():
    rows = [row("ddp", wan_bytes_per_step=10_000_000, val_loss=5.00, T_s=900.0),
            row("chosen", wan_bytes_per_step=80_000, val_loss=5.08, T_s=200.0)]
    said = "\n".join(verdicts(rows, {"killed_at": 75, "restarts": 1, "round_step": 100, "contributors": [0],
                                     "wait_s": 5.0, "deadline_s": 5.0, "rejoined": True, "each_step_once": True}))
    assert "125x below DDP's (met" in said
    assert "+1.60% of DDP's over seeds [1, 2, 3] (met" in said
    assert "4.5x better than DDP (met" in said
    assert "with replicas [0] after 5.0 s (deadline 5 s)" in said and said.endswith("(met)")
    worse = verdicts([row("ddp", val_loss=5.0), row("chosen", val_loss=5.2), row("sharded", val_loss=5.05)], None)
    assert worse == ["R = 2: chosen: validation loss at equal tokens +4.00% of DDP's over seeds [1, 2, 3] (NOT met, "
                     "target within 2%)", "R = 2: sharded: validation loss at equal tokens +1.00% of DDP's over seeds "
                     "[1, 2, 3] (met, target within 2%)"]


def test_a_curve_ends_on_its_last_round_and_the_row_counts_its_tokens():
    assert last_evaluated(300, 16) == 288 and last_evaluated(300, 50) == 300 and last_evaluated(40, 10) == 40
    plan = Plan(args(quick=False, settings=["ddp", "chosen"], max_steps=300))
    assert plan.every == 16
    assert Plan(args(quick=False, settings=["ddp"], max_steps=300)).every == 16  # alone: where it is compared
    row = plan.row(SETTINGS["chosen"], 2, {1: [[16, 7.0], [288, 6.0]]}, {}, None)
    assert row["tokens"] == 288 * 2 * 16 * 128 and row["val_loss"] == 6.0


def test_a_schedule_is_every_systems_and_a_kept_run_of_another_job_is_no_cache(tmp_path):
    plan = Plan(args(quick=False, settings=["ddp", "chosen"], lr_schedule="cosine"))
    for setting in plan.settings:  # DDP builds the same stage from the same job: the same schedule
        assert next(iter(plan.job(setting, 2, 1, 500)["stages"].values()))["lr_schedule"] == "cosine"
    assert "lr_schedule" not in plan.job(SETTINGS["chosen"], 2, 1, 30)["stages"]["whole"]  # a speed run's 30
    constant = Plan(args(quick=False, settings=["chosen"])).job(SETTINGS["chosen"], 2, 1, 500)
    write(tmp_path / "run", constant)
    assert same_job(tmp_path / "run", constant)
    assert not same_job(tmp_path / "run", plan.job(SETTINGS["chosen"], 2, 1, 500))


def test_a_warm_start_is_every_systems_and_the_verdict_sets_the_gap_beside_ddps_fall(tmp_path):
    with pytest.raises(ConfigError, match="--warm-start -1"):
        Plan(args(warm_start=-1))
    plan = Plan(args(quick=False, settings=["ddp", "chosen"], warm_start=500, max_steps=300))
    plan.inits, plan.init_loss = {12: tmp_path / "w.pt"}, {12: 5.5}  # what run() fills from the warm-ups
    for setting in plan.settings:  # DDP and the replicas start from the same file
        assert plan.job(setting, 2, 12, 300)["stages"]["whole"]["init_from"] == str(tmp_path / "w.pt")
    assert "init_from" not in plan.job(SETTINGS["ddp"], 2, 12 + 1000, 500)["stages"]["whole"]  # the warm-up itself
    ddp, ours = (plan.row(SETTINGS[name], 2, {12: [[288, loss]]}, {}, None) for name, loss in
                 (("ddp", 5.0), ("chosen", 5.1)))
    assert ddp["warm_start"] == 500 and ddp["init_loss"] == 5.5
    assert "DDP's loss fell 0.5000 since, ours 0.4000 (the gap is 20% of DDP's fall)" in "\n".join(verdicts([ddp, ours],
                                                                                                       None))


def test_no_scenario_is_refused_for_options_it_was_not_given():
    """A scenario's own options default to None: another scenario run without them is not refused (a default
    of 0 for --warm-start refused every other scenario's bench)."""
    from nebula.cli import build_parser
    from nebula_lab.bench.scenarios import scenario_names
    from nebula_lab.bench.wan import check_scenario_options
    parser = build_parser()
    for name in scenario_names():
        check_scenario_options(parser.parse_args(["bench", "wan", "--scenario", name]))
    with pytest.raises(ConfigError, match="--warm-start: only with --scenario replicas"):
        check_scenario_options(parser.parse_args(["bench", "wan", "--scenario", "gpt", "--warm-start", "5"]))
