"""The split workload (issue 52): any model from a job file, cut by torch's splitter, no stage code.

- Equivalence (point 4): `nebula split verify`'s check, split vs unsplit in one process, for both families
  (GPT-2 from a config; BERT with local weights, dropout on) cut in 2 and 4, and the torch.nn.Sequential
  fallback; and a check that can fail. The runtime itself (in-process channels, synchronous, no codec)
  trains a split job to the weights the whole model reaches, relays included.
- What cannot be split is refused when the job loads, naming the point or the weight.
"""
import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import tomli_w
import tomllib
import torch
from safetensors.torch import save_file

from nebula.cli import main
from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from services.split import verify as verify_module
from services.split.pairs import prepare_pairs
from tests.support.runtime import run_job
from tests.support.split import BERT, CORPUS, base_model_file, bert_job, factory_job, gpt2_job

FAMILIES = {"gpt2-2": (gpt2_job, ["transformer.h.2"]),
            "gpt2-4": (gpt2_job, ["transformer.h.1", "transformer.h.2", "transformer.h.3"]),
            "bert-2": (bert_job, ["bert.encoder.layer.2"]),
            "bert-4": (bert_job, ["bert.encoder.layer.1", "bert.encoder.layer.2", "bert.encoder.layer.3"])}


# two cuts in the default suite (GPT-2 in two as a user runs it, BERT in four), the other two slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("gpt2-4", "bert-2") else c
                                  for c in FAMILIES])
def test_the_split_model_has_the_unsplit_models_loss_and_gradients(tmp_path, case, capsys):
    make, points = FAMILIES[case]
    path = make(tmp_path, points)
    job = load_job(path)
    if case == "gpt2-2":  # as a user runs it
        assert main(["split", "verify", "--job", str(path), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
    else:
        result = verify_module.verify(job)
    assert result["ok"], result
    assert result["loss_diff"] <= 1e-6 and result["max_rel_grad_diff"] <= 1e-5
    assert len(result["parts"]) == len(points) + 1 and result["loss_split"] > 0
    assert result["parameters"] == len(_model_parameters(job))  # every parameter of the model, each compared once


def _model_parameters(job) -> list[str]:
    from services.split.chain import base_dir
    from services.split.model import build_model

    return [n for n, p in build_model(job.stage("p0").options.model, base_dir(job), "meta").named_parameters()
            if p.requires_grad]


def test_the_check_can_fail(tmp_path, monkeypatch):
    """A part that computes a little differently is caught, with the parameter it shows in."""
    job = load_job(gpt2_job(tmp_path, ["transformer.h.2"]))
    real = verify_module._split_pass

    def off(stages, batches):
        forward = stages[0].forward
        stages[0].forward = lambda b, i: _scaled(forward(b, i))
        return real(stages, batches)
    monkeypatch.setattr(verify_module, "_split_pass", off)
    result = verify_module.verify(job)
    assert not result["ok"] and result["max_rel_grad_diff"] > 1e-3


def _scaled(out):
    out.tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in out.tensors.items()}
    return out


def test_a_sequential_model_torch_export_cannot_trace_splits_with_the_fallback(tmp_path):
    with pytest.raises(ConfigError, match="torch.export cannot trace Sequential.*splitter = \"sequential\""):
        load_job(factory_job(tmp_path / "export", "tests.support.split:branchy", ["2"], links=[("x",)]))
    job = load_job(factory_job(tmp_path / "seq", "tests.support.split:branchy", ["1", "3"], splitter="sequential"))
    assert [link.tensors for link in job.links] == [("cut1",), ("cut2",)]
    result = verify_module.verify(job)
    assert result["ok"] and result["max_rel_grad_diff"] <= 1e-6, result


@pytest.mark.parametrize("points", [["transformer.h.2"], ["transformer.h.1", "transformer.h.3"]])
def test_the_runtime_trains_a_split_job_to_the_whole_models_weights(tmp_path, points):
    """Synchronous, no codec, in-process channels: every step's update equals the unsplit model's; with
    three parts the causal mask of part 0 is relayed by part 1 to part 2."""
    split = run_job(load_job(gpt2_job(tmp_path / "split", points)), tmp_path / "run-split", timeout=120)
    whole = run_job(load_job(gpt2_job(tmp_path / "whole", [])), tmp_path / "run-whole", timeout=120)
    merged = {k: v for name in split.job.stages for k, v in split.weights(name).items()}
    want = whole.weights("p0")
    assert merged.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(want["model.lm_head.weight"], _initial(tmp_path / "whole"))  # it did train
    ledgers = {json.loads((tmp_path / "run-split" / n / "ledger.json").read_text())["steps"].__repr__()
               for n in split.job.stages}
    assert len(ledgers) == 1  # every part applied the same steps on the same examples


def _initial(root):
    return torch.load(root.parent / "run-whole" / "p0" / "checkpoints" / "step-00000000.pt",
                      weights_only=False)["stage"]["weights"]["model.lm_head.weight"]


def test_a_split_job_trains_one_step_stale_with_lossy_codecs_and_scores_its_evaluation(tmp_path):
    codecs = {"forward": "int8", "backward": "int8", "overrides": {"expand": {"forward": "deflate"}}}
    path = bert_job(tmp_path, ["bert.encoder.layer.2"], schedule="one-step-stale", steps=6, compression=codecs,
                    stage={"eval_examples": 9, "eval_batch_size": 4})
    running = run_job(load_job(path), tmp_path / "run", timeout=120)
    scores = json.loads((tmp_path / "run" / "p0" / "scores-valid.json").read_text())
    assert scores["n"] == 9 and 0 <= scores["accuracy"] <= 1 and scores["loss"] > 0  # 9: a padded last piece
    sent = [json.loads(line) for line in (tmp_path / "run" / "p0" / "link.jsonl").read_text().splitlines()]
    hidden = next(name for name in running.job.links[0].tensors if name != "expand")
    assert {(r["name"], r["codec"]) for r in sent if r["dir"] == "forward" and r["name"] != "example_ids"} == \
        {(hidden, "int8"), ("expand", "deflate")}
    assert running.weights("p1")["model.classifier.weight"].abs().sum() > 0


# -- what cannot be split ----------------------------------------------------------------------------------
def test_a_point_that_names_no_module(tmp_path):
    with pytest.raises(ConfigError, match=r"split point 'transformer.h.9' names no module of GPT2LMHeadModel "
                                          r"\(did you mean 'transformer.h.\d'\?\)"):
        load_job(gpt2_job(tmp_path, ["transformer.h.9"], links=[("x",)]))


def test_points_out_of_forward_order(tmp_path):
    with pytest.raises(ConfigError, match=r"forward order: the model runs them as \['transformer.h.1', "
                                          r"'transformer.h.3'\]"):
        load_job(gpt2_job(tmp_path, ["transformer.h.3", "transformer.h.1"], links=[("x",), ("x",)]))


def test_a_point_the_forward_never_runs_and_a_module_no_part_owns(tmp_path):
    with pytest.raises(ConfigError, match="split point 'spare' never runs in the model's forward"):
        load_job(factory_job(tmp_path / "a", "tests.support.split:WithSpare", ["spare"], links=[("x",)]))
    with pytest.raises(ConfigError, match="module 'spare' holds weights .* that no part uses"):
        load_job(factory_job(tmp_path / "b", "tests.support.split:WithSpare", ["second"], links=[("x",)]))


def test_tied_weights_across_a_cut(tmp_path):
    with pytest.raises(ConfigError, match=r"weight lm_head.weight, transformer.wte.weight \(one parameter\) is "
                                          r"used on both sides of split point 'transformer.h.2'.*tie_word_embeddings"):
        load_job(gpt2_job(tmp_path, ["transformer.h.2"], config={"tie_word_embeddings": True}, links=[("x",)]))


def test_a_cut_that_would_carry_a_tensor_without_the_batch_first(tmp_path):
    with pytest.raises(ConfigError, match=r"the cut at split point 'second' would carry .* \(8,\), whose first "
                                          r"dimension is not the batch"):
        load_job(factory_job(tmp_path, "tests.support.split:Positions", ["second"], links=[("x",)]))


def test_the_parts_must_make_one_chain(tmp_path):
    path = gpt2_job(tmp_path, ["transformer.h.2"])
    table = tomllib.loads(path.read_text())
    faults = {"both hold part 0": lambda t: t["stages"]["p1"].update(part=0),
              "p0->p1: backward = false, but the parts train as one model": lambda t: t["links"][0].update(
                  backward=False),
              r"\[stages.p1\].model differs from \[stages.p0\].model": lambda t: t["stages"]["p1"]["model"].update(
                  points=["transformer.h.3"]),
              "no link from p0 \\(part 0\\) to p1 \\(part 1\\)": lambda t: t.update(links=[])}
    for message, change in faults.items():
        broken = copy.deepcopy(table)
        change(broken)
        path.write_text(tomli_w.dumps(broken))
        with pytest.raises(ConfigError, match=message):
            load_job(path)


# -- weights that do not fit their config ----------------------------------------------------------------
@pytest.mark.parametrize("fault,message", [
    ("shape", r"bert.embeddings.word_embeddings.weight is \(30522, 48\) in the file but \(30522, 32\) in the model"),
    ("missing", r"lacks bert.encoder.layer.0.attention.self.query.weight .*model.fresh"),
    ("extra", r"bogus.weight is not a tensor of the model")])
def test_weights_that_do_not_match_the_config_name_the_first_such_tensor(tmp_path, fault, message):
    path = bert_job(tmp_path, ["bert.encoder.layer.2"])
    tensors = base_model_file(tmp_path / "bert.safetensors")
    if fault == "shape":
        from transformers import BertConfig, BertModel
        tensors = BertModel(BertConfig(**{**BERT, "hidden_size": 48, "intermediate_size": 96})).state_dict()
    elif fault == "missing":
        del tensors["encoder.layer.0.attention.self.query.weight"]
    else:
        tensors["bogus.weight"] = torch.zeros(2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "bert.safetensors"))
    with pytest.raises(ConfigError, match=message):
        verify_module.verify(load_job(path))  # the weights load when a stage builds its part


# -- the classification data ---------------------------------------------------------------------------------
def test_pair_detection_is_balanced_and_neither_side_gives_the_label(tmp_path):
    manifest = prepare_pairs(CORPUS, tmp_path, max_train=100, seed=0)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert manifest["chance"] == 0.5 and manifest["examples"]["train"] == len(rows) == 200
    assert sum(r["label"] for r in rows) == 100
    for side in ("en", "es"):  # each sentence once in each class
        labels: dict[str, list[int]] = {}
        for r in rows:
            labels.setdefault(r[side], []).append(r["label"])
        assert all(sorted(v) == [0, 1] for v in labels.values() if len(v) == 2)
    truth = {(r["en"], r["es"]) for r in rows if r["label"] == 1}
    assert not [r for r in rows if r["label"] == 0 and (r["en"], r["es"]) in truth]
    assert 0.4 <= manifest["length_rule"]["valid"] <= 0.75  # length is not the answer


def test_jsonl_parquet_and_a_saved_datasetdict_give_the_same_examples(tmp_path):
    import datasets

    from services.split.data import open_examples

    job = load_job(bert_job(tmp_path, ["bert.encoder.layer.2"]))
    spec, base = job.stage("p0").options.data, tmp_path
    tables = {split: datasets.load_dataset("json", data_files=str(tmp_path / "data" / f"{split}.jsonl"),
                                           cache_dir=str(tmp_path / "cache"))["train"] for split in ("train", "valid")}
    for split, table in tables.items():
        table.to_parquet(str(tmp_path / "data" / f"{split}.parquet"))
    datasets.DatasetDict(tables).save_to_disk(str(tmp_path / "data" / "saved"))
    formats = {"json": spec, "parquet": replace(spec, format="parquet", files={}),
               "disk": replace(spec, format="disk", files={"all": "saved"})}
    opened = {name: open_examples(s, tmp_path / "data", base, tmp_path / name) for name, s in formats.items()}
    rows = [0, 5, 17]
    for name, examples in opened.items():
        assert examples.ids == opened["json"].ids, name
        for key, value in opened["json"].inputs("valid", rows).items():
            assert torch.equal(examples.inputs("valid", rows)[key], value), (name, key)
        assert torch.equal(examples.targets("valid", rows), opened["json"].targets("valid", rows))


def test_nebula_stages_lists_the_implementations_and_one_stages_options(capsys):
    assert main(["stages"]) == 0
    listed = capsys.readouterr().out
    assert "split  " in listed and "services.split.stage:SplitStage" in listed and "example-sink" in listed
    assert main(["stages", "split", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    keys = {o["key"]: o for o in described["options"]}
    assert described["inputs"] is None  # decided by the job: what the split finds
    assert keys["model.build"]["default"] == "required" and keys["model.points"]["default"] == []
    assert keys["data.seq_len"]["limits"] == {"at_least": 1} and "examples" in described["hooks"]
    assert main(["stages", "example-middle"]) == 0
    assert "in   hidden: float, rank 2, activation" in capsys.readouterr().out


def test_the_bytes_per_token_docs_model_md_states_follow_from_the_codecs():
    """docs/model.md, "Scale": what GPT-2 small's cut carries per token (d = 768, 256 positions), by codec."""
    from nebula.codecs.spec import parse

    hidden = torch.randn(2, 256, 768)  # a micro-batch of the stream: 512 tokens
    mask = torch.ones(256, 256, dtype=torch.bool).tril().expand(2, 1, 256, 256).contiguous()

    def per_token(spec, x):
        parts, _ = parse(spec).encode(x)
        return sum(p.numel() * p.element_size() for p in parts) / 512
    assert [per_token(c, hidden) for c in ("none", "bf16", "int8")] == [3072, 1536, 816]
    assert per_token("none", mask) == 256 and 3 < per_token("deflate", mask) < 5
    doc = (Path(__file__).resolve().parents[2] / "docs" / "model.md").read_text()
    assert "(3,072 uncompressed)" in doc and "(820 / 816)" in doc and "(1,540 / 1,536)" in doc
