"""The split workload's DDP peer (services/split/peer.py): a model a user brings, trained and scored by the
replicas bench's DDP ranks exactly as its stage trains and scores it; never a part of a model."""
import json

import pytest
import tomli_w
import tomllib
import torch

from nebula.errors import ConfigError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from nebula.runtime.service import build_stage
from nebula.runtime.stage import Batch
from services.split.peer import SplitPeer
from tests.support.split import gpt2_job


def replicated(root, **stage):
    path = gpt2_job(root, [], steps=2, stage={"eval_examples": 8, "threads": 1, **stage})
    table = tomllib.loads(path.read_text())
    table["replicas"] = {"groups": [["a"], ["b"]], "H": 2, "codec": "int8", "deadline_s": 60}
    path.write_text(tomli_w.dumps(table))
    return load_job(path)


def test_the_peer_takes_the_stages_batches_loss_and_scores(tmp_path):
    job = replicated(tmp_path)
    run_one_site(job, tmp_path / "run", quiet=True)  # 2 steps (a round), both replicas; replica 0 scores after
    scored = [json.loads(line) for line in (tmp_path / "run" / "p0" / "valid.jsonl").read_text().splitlines()][-1]
    stage = build_stage(job.replica_view(0), "p0", tmp_path / "peer", quiet=True)
    stage.load_state_dict(CheckpointDir(tmp_path / "run" / "p0" / "checkpoints").load(scored["step"])["stage"])
    peer = SplitPeer()
    module = peer.peer_module(stage, True, True, torch.float32)
    assert peer.peer_eval(stage, module) == pytest.approx(scored["loss"], rel=1e-6)  # the runtime's evaluation
    rows = [3, 1]  # a micro-batch: the stage's forward on it, and the peer's
    inputs, targets = peer.peer_batch(stage, rows)
    want = stage.forward(Batch("train", 1, 0, ids=torch.zeros(2, dtype=torch.int64), indices=rows), {}).loss
    assert torch.equal(peer.peer_loss(module(inputs), targets), want)
    assert {n for n, _ in module.named_parameters()} == {f"model.{n}" for n, _ in stage.module.named_parameters()}
    with pytest.raises(ConfigError, match="runs a whole model"):  # asked for a part of it (a pipeline's stage)
        peer.peer_module(stage, True, False, torch.float32)

