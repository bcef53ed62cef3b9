"""What the demo's settings and its report are made of: the learning-rate schedules, adapters on the
top layers only, training on the sentences that fit, the report's traffic sums and example rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nebula.errors import ConfigError
from services.abnet import report
from services.abnet.model import AbnetConfig, NoAdapter, build_source_encoder
from services.abnet.sides import adam_with_warmup, lr_factor
from tests.support.abnet import PAIRS, sliced, vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")


def test_linear_schedule_warms_up_then_reaches_zero_at_the_last_step():
    f = lr_factor(10, "linear", 110)
    assert [round(f(s), 3) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert f(59) == pytest.approx(0.5, abs=0.011) and f(109) == pytest.approx(0.01) and f(110) == 0.0
    g = lr_factor(10, "inverse-sqrt", 0)
    assert g(9) == 1.0 and g(39) == pytest.approx(0.5)  # the paper's: sqrt(warm / step)
    with pytest.raises(ValueError, match="more steps"):
        lr_factor(10, "linear", 10)
    opt, sched = adam_with_warmup([torch.nn.Parameter(torch.zeros(1))], 1e-3, 2, "linear", 4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])  # the last step still learns, at 1/(4 - 2)


def test_adapters_on_the_top_layers_only_leave_the_lower_ones_without_a_graph(e5):
    vmap = vocab_map(e5, [s for s, _ in PAIRS])
    enc = build_source_encoder(sliced(e5, 4), AbnetConfig(enc_adapter_dim=32, adapter_layers=1), vmap)
    assert [type(a) is NoAdapter for a in enc.adapters] == [True, True, True, False]
    ids = torch.tensor([[0, 5, 6, 2]])
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad)) for layer in enc.plm.layers]
    enc(ids, torch.ones_like(ids).bool()).sum().backward()
    for h in hooks:
        h.remove()
    assert seen == [False, False, False, False]  # the last layer's input needs no grad either: only its adapter trains
    assert all(p.grad is not None for p in enc.trainable_parameters())


def test_traffic_sums_each_direction_and_names_its_codecs(tmp_path):
    log = tmp_path / "link.jsonl"
    records = [{"dir": "forward", "codec": "fp16", "raw": 400, "wire": 200},
               {"dir": "forward", "codec": "none", "raw": 10, "wire": 10},
               {"dir": "backward", "codec": "int8", "raw": 400, "wire": 106},
               {"dir": "forward", "codec": "fp16", "raw": 400, "wire": 200}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    forward = report.traffic(log, "forward")
    assert (forward.raw, forward.wire, forward.codecs) == (810, 410, ("fp16", "none"))
    assert report.traffic(log, "backward").ratio == pytest.approx(106 / 400)


def test_examples_are_evenly_spaced_and_the_report_escapes_table_cells(tmp_path):
    for stage, ext, prefix in (("encoder", "src", "es"), ("decoder", "ref", "en"), ("decoder", "hyp", "mt")):
        (tmp_path / stage).mkdir(exist_ok=True)
        (tmp_path / stage / f"test.{ext}").write_text("".join(f"{prefix} {i}\n" for i in range(30)))
    rows = report.examples(tmp_path, "encoder", "decoder", k=3)
    assert rows == [("es 0", "en 0", "mt 0"), ("es 10", "en 10", "mt 10"), ("es 20", "en 20", "mt 20")]
    (tmp_path / "encoder" / "test.src").rename(tmp_path / "encoder" / "valid.src")  # a demo scored on valid
    assert report.examples(tmp_path, "encoder", "decoder", k=3) == []
    for stage, ext in (("decoder", "ref"), ("decoder", "hyp")):
        (tmp_path / stage / f"test.{ext}").rename(tmp_path / stage / f"valid.{ext}")
    assert report.examples(tmp_path, "encoder", "decoder", k=3, split="valid") == rows
    out = report.write_report(tmp_path / "report.md", "demo", ["BLEU 3.10"], [("a | b", "c", "d")], {"job": {}})
    text = out.read_text()
    assert "| a \\| b | c | d |" in text and "- BLEU 3.10" in text and "![training loss](loss.png)" in text


def test_a_linear_schedule_shorter_than_its_warm_up_is_a_config_error(tmp_path):
    from nebula.runtime.job import parse_job
    from nebula.runtime.service import build_stage
    data = Path(__file__).parents[1] / "e2e" / "data" / "es-en"
    raw = {"job": {"name": "t", "data": str(data)}, "train": {"steps": 5},
           "stages": {"encoder": {"address": "a/encoder/0", "impl": "abnet-encoder", "warmup_steps": 10,
                                  "lr_schedule": "linear"},
                      "decoder": {"address": "b/decoder/0", "impl": "abnet-decoder", "objective": "ar"}},
           "links": [{"from": "encoder", "to": "decoder", "tensors": ["hidden", "mask"], "backward": True}]}
    with pytest.raises(ConfigError, match=r"\[stages.encoder\].*more steps \(5\) than warmup_steps \(10\)"):
        build_stage(parse_job(raw, tmp_path / "job.toml"), "encoder", tmp_path / "encoder", quiet=True)


def test_a_speed_run_of_the_demo_job_truncates_and_cuts_its_linear_warm_up_to_fit_its_few_steps(tmp_path):
    import tomllib

    from services.abnet.bench import SCENARIO
    data = tmp_path / "corpus"
    data.mkdir()
    long = " ".join(["palabra"] * 30)
    for split in ("train", "valid", "test"):
        for ext in ("src", "tgt", "ids"):
            (data / f"{split}.{ext}").write_text(f"{long}\nshort\n")
    raw = tomllib.loads((Path(__file__).parents[2] / "deploy" / "jobs" / "abnet-es-en.toml").read_text())
    raw["job"]["data"] = str(data)
    job = SCENARIO.speed_job(raw, tmp_path / "work", 11)
    stages = job["stages"].values()
    assert [s["warmup_steps"] for s in stages] == [10, 10]  # the demo's 50 would refuse 11 steps
    assert not any("long_sentences" in s for s in stages)  # truncated to max_len: "skip" would leave none
    lr_factor(10, "linear", 11)  # what the stages then build: accepted
    assert (tmp_path / "work" / "data" / "train.src").read_text() == f"{long}\n"  # the fixed-shape pairs only


def test_the_demo_s_monitor_reads_only_what_was_appended_and_its_cost_does_not_grow_with_the_run(tmp_path):
    """LastStep: the newest step record; a line half written waits for the next look; each look reads the new
    bytes only, so 800 steps in, a look costs what it did at step 1 (re-reading the whole file did not)."""
    from nebula.observe.tail import LastStep
    metrics = tmp_path / "metrics.jsonl"
    tail = LastStep(metrics)
    assert tail.latest() is None  # no file yet: the stage has not started
    record = {"t": 0.0, "kind": "step", "step": 1, "step_s": 0.5, "compute_s": 0.4, "loss": 9.1, "sent": {"x": 9}}
    metrics.write_text(json.dumps(record) + "\n" + '{"kind": "event", "event": "checkpoint", "step": 1}\n{"kind": "st')
    assert tail.latest()["step"] == 1 and tail.tail.offset < metrics.stat().st_size
    with open(metrics, "a") as f:
        f.write('ep", "step": 2, "loss": 8.0}\n')
    assert tail.latest() == {"kind": "step", "step": 2, "loss": 8.0}
    assert tail.latest()["step"] == 2  # nothing new: the last one again

    lines = "".join(json.dumps({**record, "step": s}) + "\n" for s in range(3, 803))
    with open(metrics, "a") as f:
        f.write(lines)
    assert tail.latest()["step"] == 802 and tail.tail.offset == metrics.stat().st_size
    metrics.write_bytes(b"x" * tail.tail.offset + b'{"kind": "step", "step": 803, "loss": 7.0}\n')  # old bytes unread
    assert tail.latest()["step"] == 803


def test_the_demo_estimates_its_time_from_its_own_steps_once():
    from services.abnet.demo import EVAL_STEPS_PER_SENTENCE, TIMED_FROM, TIMED_STEPS, Estimate
    estimate = Estimate(total=400, sentences=400)
    assert estimate.see(1, 0.0) is None and estimate.see(TIMED_FROM, 100.0) is None  # the start, then the clock
    assert estimate.see(TIMED_FROM + TIMED_STEPS - 1, 109.5) is None
    line = estimate.see(TIMED_FROM + TIMED_STEPS, 110.0)  # 0.5 s a step
    left, evaluate = (400 - TIMED_FROM - TIMED_STEPS) * 0.5, 400 * EVAL_STEPS_PER_SENTENCE * 0.5
    assert line.startswith(f"at this machine's pace (0.50 s a step over steps {TIMED_FROM}-{TIMED_FROM + TIMED_STEPS})")
    assert f"~{left / 60:.1f} min of training left, then ~{evaluate / 60:.1f} min translating 400 sentences" in line
    assert estimate.see(TIMED_FROM + TIMED_STEPS + 1, 111.0) is None  # said once
