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
