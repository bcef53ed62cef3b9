"""The GPT split into parts is the unsplit model (services/gpt/model.py), and its stages train on one site
through the real runtime, codecs and evaluation (services/gpt/stages.py)."""
import json
import math

import pytest
import torch

from nebula.runtime.job import load_job
from nebula.runtime.lr import warmup_decay
from nebula.runtime.onesite import run_one_site
from nebula.runtime.records import read_records
from services.gpt.model import GptConfig, GptPart, lm_loss
from tests.support.gpt import TINY, gpt_job

CFG = GptConfig(vocab_size=64, d_model=16, n_head=2, n_layer=4, seq_len=16)


def test_parts_chained_compute_the_whole_model_and_its_gradients():
    torch.manual_seed(0)
    whole = GptPart(CFG, 0, 4, embed=True, head=True)
    head, tail = GptPart(CFG, 0, 2, embed=True, head=False), GptPart(CFG, 2, 4, embed=False, head=True)
    head.embed, tail.ln_f, tail.head = whole.embed, whole.ln_f, whole.head  # the same weights, shared
    head.blocks, tail.blocks = whole.blocks[:2], whole.blocks[2:]
    tokens = torch.randint(0, 64, (3, 16))
    targets = torch.randint(0, 64, (3, 16))
    hidden = head(tokens)  # (B, T, d): what the first stage sends
    sent = hidden.detach().requires_grad_()
    lm_loss(tail(tokens, sent), targets).backward()
    hidden.backward(sent.grad)  # the gradient that comes back on the link
    split = {k: p.grad.clone() for k, p in whole.named_parameters()}
    whole.zero_grad()
    reference = lm_loss(whole(tokens), targets)
    reference.backward()
    assert hidden.shape == (3, 16, 16)
    for name, p in whole.named_parameters():
        torch.testing.assert_close(split[name], p.grad, msg=name)


def test_a_bottleneck_sends_k_wide_codes_and_the_receiver_adds_its_own_token_embedding():
    sender = GptPart(CFG, 0, 2, embed=True, head=False, code_out=4)
    receiver = GptPart(CFG, 2, 4, embed=False, head=True, code_in=4, reembed=True)
    tokens = torch.randint(0, 64, (2, 16))
    code = sender(tokens)
    assert code.shape == (2, 16, 4) and receiver.embed is not None
    assert receiver(tokens, code).shape == (2, 16, 64)
    assert GptPart(CFG, 2, 4, embed=False, head=True, code_in=4, reembed=False).embed is None


def test_a_split_job_trains_on_one_site_and_scores_its_validation_loss(tmp_path):
    """Three stages, a bottleneck of 4 in int8 on both links: the codes cross as (B, T, 4), the loss falls,
    the evaluation after training lands in valid.jsonl."""
    job = load_job(gpt_job(tmp_path, steps=12, bottleneck=4, compression={"forward": "int8", "backward": "int8"}))
    run_one_site(job, tmp_path / "run", quiet=True)
    losses = [r["loss"] for r in read_records(tmp_path / "run" / "last" / "metrics.jsonl")]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    sent = [r for r in read_records(tmp_path / "run" / "first" / "link.jsonl", kind=None)
            if r.get("name") == "hidden" and "split" not in r]
    assert {r["raw"] for r in sent} == {2 * TINY["seq_len"] * 4 * 4}  # (B / micro-batches, T, k) float32
    assert {r["codec"] for r in sent} == {"int8"}
    curve = [json.loads(line) for line in (tmp_path / "run" / "first" / "valid.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [12] and 0 < curve[0]["loss"] < 10


def test_a_schedule_warms_up_then_decays_to_0_at_the_jobs_last_step_and_the_stage_runs_it(tmp_path):
    constant, linear, cosine = (warmup_decay(10, decay, 100) for decay in ("constant", "linear", "cosine"))
    assert constant(4) == linear(4) == cosine(4) == 0.5 and constant(10) == linear(10) == cosine(10) == 1.0
    assert constant(99) == 1.0 and linear(55) == 0.5 and cosine(55) == pytest.approx(0.5)
    assert cosine(100) == linear(100) == 0.0 and all(cosine(s) > cosine(s + 1) for s in range(10, 100))
    with pytest.raises(ValueError, match="unknown decay 'step': one of constant, linear, cosine"):
        warmup_decay(10, "step", 100)
    job = load_job(gpt_job(tmp_path, chain=(("whole", "gpt-whole", [0, 4]),), steps=4, warmup_steps=1,
                           lr_schedule="cosine"))
    run_one_site(job, tmp_path / "run", quiet=True)
    state = torch.load(tmp_path / "run" / "whole" / "checkpoints" / "step-00000002.pt", weights_only=False)
    assert state["stage"]["scheduler"]["_last_lr"][0] == pytest.approx(TINY["lr"] * cosine_at(2, 1, 4))


def cosine_at(step, warmup, total):
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
