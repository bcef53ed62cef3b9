"""The graph runtime with small real torch stages (services/example) over in-process channels:
every schedule equals its unpipelined reference, a stage killed mid-training resumes with no example
lost or applied twice (and, with stateful codecs, exactly as if never interrupted), the pace credit
holds a forward-only sender back, a long evaluation completes by reporting progress, and a stage that
receives nothing says whom it waits for."""
import json
import re
import time

import pytest
import torch

import nebula.runtime.inbox as inbox_module
from nebula.runtime.executor import _Bound
from nebula.runtime.order import ExampleOrder, digest, id_hashes
from nebula.runtime.schedules import schedule_names
from nebula.runtime.service import build_stage, make_runner
from nebula.runtime.stage import Batch
from nebula.transport.inproc import InProcHub
from tests.support.runtime import TIMELINE, Running, example_job, run_job

CRASHING = "tests.support.runtime:CrashingSink"
TIMED = "tests.support.runtime:TimedSource"


def reference(job, root):
    """Unpipelined training in one process, stage after stage, one optimiser step per step.
    Weights: a stage with a two-way out-link runs step t at W_{t-2} under one-step-stale (W_{t-1}
    right after a checkpoint); everything else at W_{t-1}."""
    graph, train = job.graph, job.train
    stages = {name: build_stage(job, name, root / name, quiet=True) for name in graph.order}
    after = {name: {0: {k: p.detach().clone() for k, p in s.trainable().items()}} for name, s in stages.items()}
    hashes = id_hashes(stages["src"].examples("train"))
    order = ExampleOrder(len(hashes), train.batch_size, train.seed)
    for t in range(1, train.steps + 1):
        used = {}
        for name in stages:
            stale = job.schedule.name == "one-step-stale" and graph.waits_for_gradients(name) and t > 1 \
                and not train.saves_after(t - 1)
            used[name] = {k: v.clone().requires_grad_() for k, v in after[name][t - 2 if stale else t - 1].items()}
        idx = order.indices(t)
        for m in range(train.micro_batches):
            chosen = idx[m::train.micro_batches]
            batch = Batch("train", t, m, ids=hashes[chosen], indices=chosen)
            received, sent, loss_sum = {}, {}, []
            for name in graph.order:
                link = graph.in_links[name][0] if graph.in_links[name] else None
                inputs = {}
                if link is not None:
                    h = sent[link.src].detach()
                    inputs = {"hidden": h.requires_grad_() if link.backward else h}
                    received[name] = inputs["hidden"]
                named = {f"inner.{k}": v for k, v in used[name].items()}
                out = torch.func.functional_call(_Bound(stages[name]), named, (batch, inputs), strict=False)
                if out.loss is not None:
                    loss_sum.append(out.loss / train.micro_batches)
                if "hidden" in out.tensors:
                    sent[name] = out.tensors["hidden"]
            for loss in loss_sum:
                loss.backward(retain_graph=True)
            for name in reversed(graph.order):  # gradients back along the two-way links
                for link in graph.out_links[name]:
                    if link.backward:
                        sent[name].backward(received[link.dst].grad, retain_graph=True)
        for name, stage in stages.items():
            for k, p in stage.trainable().items():
                p.grad = used[name][k].grad
            stage.optimizer.step()
            stage.optimizer.zero_grad(set_to_none=True)
            after[name][t] = {k: p.detach().clone() for k, p in stage.trainable().items()}
    return stages, [[s, digest(hashes[order.indices(s)].tolist())] for s in range(1, train.steps + 1)]


def assert_same(running, stages, rtol=1e-5, atol=1e-6):
    for name, stage in stages.items():
        for key, want in stage.trainable().items():
            torch.testing.assert_close(running.weights(name)[key], want.detach(), rtol=rtol, atol=atol,
                                       msg=lambda m, name=name, key=key: f"{name}.{key}: {m}")


def ledgers(running) -> dict:
    return {name: json.loads((running.root / name / "ledger.json").read_text())["steps"] for name in running.job.stages}


CASES = {"sync": dict(stages=2), "stale": dict(stages=2, schedule="one-step-stale"),
         "chain-sync": dict(stages=3), "chain-stale": dict(stages=3, schedule="one-step-stale"),
         "fan-out": dict(stages="fan-out"), "fan-out-stale": dict(stages="fan-out", schedule="one-step-stale"),
         "forward-only": dict(stages=2, schedule="forward-only", backward=False, local_loss=True, credit=2),
         "gpipe": dict(stages=3, schedule="gpipe"), "gpipe-fan-out": dict(stages="fan-out", schedule="gpipe"),
         "1f1b": dict(stages=3, schedule="1f1b", micro_batches=8),
         "1f1b-stages": dict(stages=3, schedule="1f1b", micro_batches=8, schedule_options={"in_flight": "stages"}),
         "1f1b-one": dict(stages="fan-out", schedule="1f1b", schedule_options={"in_flight": 1})}


def test_the_equivalence_test_below_covers_every_registered_schedule():
    assert {case.get("schedule", "synchronous") for case in CASES.values()} == set(schedule_names())


@pytest.mark.parametrize("case", CASES)
def test_every_schedule_equals_its_unpipelined_reference(tmp_path, case):
    job = example_job(**CASES[case])
    running = run_job(job, tmp_path / "run")
    stages, expected = reference(job, tmp_path / "ref")
    assert_same(running, stages)
    assert all(ledger == expected for ledger in ledgers(running).values())


def test_stale_reference_is_another_path(tmp_path):
    """So the stale cases above check something: one-step-stale differs from synchronous."""
    root = tmp_path
    sync = reference(example_job(stages=3), root / "a")[0]["src"].trainable()["layer.weight"]
    stale_stages = reference(example_job(stages=3, schedule="one-step-stale"), root / "b")[0]
    stale = stale_stages["src"].trainable()["layer.weight"]
    assert not torch.allclose(sync, stale, atol=1e-4)


def test_lossy_codec_stays_close_to_the_reference(tmp_path):
    job = example_job(compression={"forward": "fp16", "backward": "int8"})
    running = run_job(job, tmp_path / "run")
    stages, _ = reference(example_job(), tmp_path / "ref")
    diff = (running.weights("src")["layer.weight"] - stages["src"].trainable()["layer.weight"]).abs().max()
    assert 0 < diff < 0.05  # compressed, so not identical, but close


FAR_AHEAD = dict(CASES["forward-only"], credit=3, checkpoint_every=1)


@pytest.mark.parametrize("case, crash_at", [("sync", 8), ("chain-stale", 8), ("forward-only", 8),
                                             ("sync", 12), ("forward-only", 11), ("far-ahead", 8)])
def test_killed_stage_resumes_without_loss_or_repeat(tmp_path, case, crash_at):
    """The sink dies in the middle of step 8 (after the checkpoint of step 6) and is restarted: the job
    equals its reference and every stage's ledger lists every step once. Also in the last step (12),
    or, forward-only, in step 11 (the source ran its credit ahead to the end): the source has
    announced the end by then, and the sink comes back without the final checkpoint. "far-ahead": a
    source 3 steps ahead with a checkpoint every step still holds one the sink has (it kept only 3)."""
    kw = {**(FAR_AHEAD if case == "far-ahead" else CASES[case]), "sink_impl": CRASHING}
    job, crashed = example_job(**kw), example_job(**kw, sink_options={"crash_at": crash_at})
    running = run_job(job, tmp_path / "run", crash="sink", crashed_job=crashed)
    stages, expected = reference(job, tmp_path / "ref")
    assert_same(running, stages)
    assert all(ledger == expected for ledger in ledgers(running).values())
    coordinator = running.runners["src"]
    assert coordinator.generations.current == 2  # one resume after the first agreement


def test_resumed_run_equals_uninterrupted_with_stateful_codecs(tmp_path):
    """ef(topk(0.01)) keeps a residual per tensor at each sender: a resumed run restores it from the
    checkpoint, so it ends exactly where the uninterrupted run does (without the restore it does not:
    checked by hand when this test was written)."""
    kw = dict(stages=3, sink_impl=CRASHING, compression={"forward": "ef(topk(0.01))", "backward": "ef(topk(0.01))"})
    job, crashed = example_job(**kw), example_job(**kw, sink_options={"crash_at": 8})
    whole = run_job(job, tmp_path / "whole")
    resumed = run_job(job, tmp_path / "resumed", crash="sink", crashed_job=crashed)
    for name in job.stages:
        for key, value in whole.weights(name).items():
            torch.testing.assert_close(resumed.weights(name)[key], value, rtol=0, atol=0)
    reference_stages, _ = reference(example_job(stages=3), tmp_path / "ref")  # the codec is lossy: not equal
    assert not torch.allclose(whole.weights("src")["layer.weight"], reference_stages["src"].trainable()["layer.weight"])


def test_a_resumed_stage_has_the_running_statistics_of_an_uninterrupted_one(tmp_path):
    """BatchNorm's running mean is module state that is not a weight: it used to be left out of the
    checkpoint, and a resumed sink had only the steps after its restart in it."""
    kw = dict(stages=2, sink_impl="tests.support.runtime:NormedSink")
    job, crashed = example_job(**kw), example_job(**kw, sink_options={"crash_at": 8})
    whole = run_job(job, tmp_path / "whole")
    resumed = run_job(job, tmp_path / "resumed", crash="sink", crashed_job=crashed)
    norms = [run.runners["sink"].stage.module[0] for run in (whole, resumed)]
    assert int(norms[0].num_batches_tracked) == 12 * 4
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(norms[1], name), getattr(norms[0], name), rtol=0, atol=0)


def test_pace_credit_bounds_how_far_a_forward_only_sender_runs_ahead(tmp_path):
    TIMELINE.clear()
    job = example_job(schedule="forward-only", backward=False, local_loss=True, credit=2, steps=10,
                      source_impl=TIMED, sink_impl=CRASHING, checkpoint_every=100,
                      sink_options={"slow_apply": 0.1})  # 10 ms was not slower than a sender on a loaded CI host
    run_job(job, tmp_path / "run")
    applied, ahead = 0, []
    for _, event, step in sorted(TIMELINE):
        if event == "sink-applied":
            applied = step
        else:
            ahead.append(step - applied)
    assert max(ahead) == 2, ahead  # opened step t only once the sink had applied t - 2, and did use the credit


def test_evaluation_longer_than_the_timeout_completes_reporting_progress(tmp_path):
    job = example_job(steps=3, sink_impl=CRASHING, sink_options={"slow_infer": 0.4})
    running = Running(job, tmp_path / "run", InProcHub())
    channel = running.hub.channel("a/src/0")
    running.start("sink")
    stage = build_stage(job, "src", tmp_path / "run" / "src", quiet=True)
    runner = make_runner(job, "src", stage, channel, timeout=1.0)
    result = runner.run(hook=lambda r: r.evaluate("test", list(range(16)), batch_size=2))  # 8 batches, 3.2 s
    runner.close()
    running.join()
    assert result["sink"]["n"] == 16 and result["sink"]["mse"] > 0
    decoded = [r["n"] for r in runner.metrics.records if r.get("event") == "decoded"]
    assert decoded[-1] == 16


def test_a_stage_that_receives_nothing_says_whom_it_waits_for_and_goes_on_waiting(tmp_path, monkeypatch, capsys):
    """The sink started alone waits for the coordinator (the source) to resume it: it says so every
    WAIT_NOTICE_S (10 s; shortened here) on stderr, also when quiet, and in its metrics, without giving up
    before its timeout; once the source starts, the job runs."""
    monkeypatch.setattr(inbox_module, "WAIT_NOTICE_S", 0.2)
    job = example_job(steps=2)
    running = Running(job, tmp_path / "run", InProcHub())
    channels = {name: running.hub.channel(job.stage(name).address) for name in job.stages}
    running.start("sink", channel=channels["sink"])

    def waiting() -> list[dict]:
        return [r for r in running.runners["sink"].metrics.records if r.get("event") == "waiting"]
    deadline = time.monotonic() + 30
    while len(waiting()) < 3:
        assert time.monotonic() < deadline, "the sink said nothing while it waited"
        time.sleep(0.05)
    running.start("src", channel=channels["src"])
    running.join()
    first, second = waiting()[:2]
    assert first["stages"] == ["src"] and second["since_s"] > first["since_s"]
    lines = re.findall(r"^\[sink\] waiting for src \(a/src/0\) since \d+ s$", capsys.readouterr().err, re.M)
    assert len(lines) == len(waiting())
    assert ledgers(running)["sink"] == ledgers(running)["src"]


def test_the_in_memory_records_keep_only_the_latest(tmp_path, monkeypatch):
    """Every step and event record was kept in memory for the life of the process; the file has them all."""
    from nebula.runtime import metrics
    monkeypatch.setattr(metrics, "RECENT", 5)
    log = metrics.MetricsLog(tmp_path / "m.jsonl", "s", quiet=True)
    for step in range(1, 13):
        log.step(step=step, loss=1.0)
    log.close()
    assert [r["step"] for r in log.records] == [8, 9, 10, 11, 12]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 12


def test_a_one_step_stale_job_hot_starts_from_a_step_off_its_checkpoint_grid(tmp_path):
    """`one-site --until 5` then the cross-site run from step 5 (checkpoint_every 3): step 6 used to look
    for weights stashed across step 5, which nothing had stashed, and the job failed."""
    from nebula.runtime.onesite import run_one_site
    from nebula.site.local import hot_start
    job = example_job(stages=2, schedule="one-step-stale")
    run_one_site(job, tmp_path / "one-site", quiet=True, until=5)
    hot_start(tmp_path / "run", tmp_path / "one-site", list(job.stages))
    running = run_job(job, tmp_path / "run")
    assert all(runner.step == 12 for runner in running.runners.values())
    assert all(len(ledger) == 12 for ledger in ledgers(running).values())
