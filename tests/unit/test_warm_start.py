"""A stage's `init_from` (nebula.runtime.warm_start): it starts from a file's weights, of any of the three kinds a
user has (a Nebula checkpoint, a stage's state, a module's state_dict), relative to the job file; a file
that does not fit says why; replicas started from one file start with one anchor."""
import json
import os
import shutil

import pytest
import tomli_w
import torch

from nebula.errors import ConfigError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from nebula.runtime.service import build_stage
from tests.support.gpt import TINY, tiny_corpus


def whole_job(root, init=None, replicas=False, **changes):
    stage = {"address": "a/whole/0", "impl": "gpt-whole", "layers": [0, 4], "device": "cpu", "threads": 1,
             "eval_examples": 8, **TINY, **changes}
    if init is not None:
        stage["init_from"] = init
    raw = {"job": {"name": "tiny-whole", "data": str(tiny_corpus(root / "data"))},
           "train": {"steps": 4, "batch_size": 4, "micro_batches": 2, "checkpoint_every": 2, "seed": 1},
           "stages": {"whole": stage}}
    if replicas:
        raw["replicas"] = {"groups": [["a"], ["b"]], "H": 2, "deadline_s": 60}
    path = root / "job.toml"
    path.write_text(tomli_w.dumps(raw))
    return load_job(path)


def trained(root):
    """A real run's checkpoint of the tiny GPT (4 steps), and its weights."""
    run_one_site(whole_job(root / "pre"), root / "pre" / "run", quiet=True)
    checkpoints = CheckpointDir(root / "pre" / "run" / "whole" / "checkpoints")
    file = checkpoints.file(checkpoints.steps()[-1])
    return file, checkpoints.load(checkpoints.steps()[-1])["stage"]


def test_a_stage_starts_from_each_kind_of_file_relative_to_the_job_file(tmp_path):
    checkpoint, state = trained(tmp_path)
    torch.save(state, tmp_path / "state.pt")
    torch.save(state["weights"], tmp_path / "weights.pt")
    random = build_stage(whole_job(tmp_path / "none"), "whole", tmp_path / "none" / "w", quiet=True).trainable()
    for i, file in enumerate([checkpoint, tmp_path / "state.pt", tmp_path / "weights.pt"]):
        root = tmp_path / f"kind{i}"
        root.mkdir()
        job = whole_job(root, init=os.path.relpath(file, root))  # as a job file would write it
        assert job.stage("whole").init_from == str(file)
        got = build_stage(job, "whole", root / "w", quiet=True).trainable()
        for name, value in state["weights"].items():
            assert torch.equal(got[name], value), (file.name, name)
        assert not torch.equal(got["head.weight"], random["head.weight"])
        events = [json.loads(line) for line in (root / "w" / "metrics.jsonl").read_text().splitlines()]
        assert {"event": "init_from", "file": str(file), "tensors": len(got), "unused": 0}.items() <= events[0].items()
    bad = tmp_path / "bad" / checkpoint.name  # a checkpoint whose bytes no longer match its checksum
    bad.parent.mkdir()
    bad.write_bytes(checkpoint.read_bytes()[:-8] + bytes(8))
    shutil.copy(f"{checkpoint}.sha256", f"{bad}.sha256")
    with pytest.raises(ConfigError, match="init_from: checkpoint .* is corrupt"):
        build_stage(whole_job(tmp_path / "bad", init=str(bad)), "whole", tmp_path / "bad" / "w", quiet=True)


@pytest.mark.parametrize("what, words", [
    ("missing", "is not a file at this site"),
    ("garbage", "is not a torch.save'd mapping of tensors"),
    ("no-weight", "has no weight"),
    ("shape", "has shape (64, 32)"),
])
def test_a_file_that_does_not_fit_says_why(tmp_path, what, words):
    file = tmp_path / "init.pt"
    other = build_stage(whole_job(tmp_path / "o", d_model=32), "whole", tmp_path / "o" / "w", quiet=True)
    same = build_stage(whole_job(tmp_path / "s"), "whole", tmp_path / "s" / "w", quiet=True)
    if what == "garbage":
        file.write_bytes(b"not a torch file")
    elif what == "no-weight":
        torch.save({k: v for k, v in same.trainable().items() if k != "head.weight"} | {"x": torch.zeros(1)}, file)
    elif what == "shape":
        torch.save(other.trainable(), file)
    job = whole_job(tmp_path, init=str(file))
    with pytest.raises(ConfigError, match=r"\[stages\.whole\]\.init_from: ") as raised:
        build_stage(job, "whole", tmp_path / "w", quiet=True)
    assert words in str(raised.value)


def test_replicas_from_one_file_start_at_its_weights_and_a_resume_keeps_its_own(tmp_path):
    file, state = trained(tmp_path)
    job = whole_job(tmp_path, init=str(file), replicas=True)
    run_one_site(job, tmp_path / "run", quiet=True, until=2)
    for instance in ("whole", "whole-r1"):  # the state each started from: the file's, at both replicas
        start = CheckpointDir(tmp_path / "run" / instance / "checkpoints").load(0)["stage"]["weights"]
        assert all(torch.equal(start[k], v) for k, v in state["weights"].items())
    run_one_site(job, tmp_path / "run", quiet=True)  # resumes at step 2 from its own checkpoints
    ledger = json.loads((tmp_path / "run" / "whole" / "ledger.json").read_text())["steps"]
    assert [step for step, _ in ledger] == [1, 2, 3, 4]
    straight = tmp_path / "straight"
    run_one_site(whole_job(straight, init=str(file), replicas=True), straight / "run", quiet=True)
    for instance in ("whole", "whole-r1"):  # as far from the file as a run without the stop
        want = CheckpointDir(straight / "run" / instance / "checkpoints").load(4)["stage"]["weights"]
        got = CheckpointDir(tmp_path / "run" / instance / "checkpoints").load(4)["stage"]["weights"]
        assert all(torch.equal(got[k], v) for k, v in want.items())
