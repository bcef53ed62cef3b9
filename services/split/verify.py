"""`nebula split verify`: is the split model the unsplit one? Checked in one process on the job's data,
before any training.

One training step of the job (step 1 of its example order, all its micro-batches) two ways, from the same
random state:

    split     each part as its stage builds it, in chain order, every boundary tensor checked against the
              ports and handed on as the runtime hands it (detached; a leaf that requires grad where it is
              floating point); the loss at the last part; gradients back part by part, as the
              synchronous schedule with no codec sends them
    unsplit   the whole model as every stage builds it, not traced, the same loss

and compares the loss and every parameter's gradient: loss_diff = |split - unsplit|, and
max_rel_grad_diff = the largest over parameters of max |g_split - g_unsplit| / max |g_unsplit|.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from nebula.errors import StageError
from nebula.runtime.order import ExampleOrder, id_hashes
from nebula.runtime.service import build_stage
from nebula.runtime.stage import Batch, Stage
from services.split.chain import base_dir, check_chain
from services.split.cut import PREFIX
from services.split.losses import checked, loss_function
from services.split.model import build_model

LOSS_TOLERANCE = 1e-5  # relative to the loss
GRAD_TOLERANCE = 1e-4  # max |difference| / max |gradient|, per parameter


def verify(job: Any, seed: int = 0) -> dict[str, Any]:
    """The comparison, as a JSON-able dict (its "ok" says whether both are within tolerance)."""
    chain = check_chain(job)
    with tempfile.TemporaryDirectory(prefix="nebula-verify-") as work:
        stages = [build_stage(job, name, Path(work) / name, quiet=True) for name in chain]
        batches = first_step(job, stages[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # dropout draws alike in both passes
            split_loss = _split_pass(stages, batches)
        split_grads = {k: p.grad for s in stages for k, p in s.trainable().items() if p.grad is not None}
        options = stages[-1].options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            whole_loss, whole_grads = _unsplit_pass(job, stages, batches, options)
    return compare(split_loss, whole_loss, split_grads, whole_grads, stages, chain)


def first_step(job: Any, head: Stage) -> list[Batch]:
    """The micro-batches of the job's step 1, as the runtime's sources cut them."""
    hashes = id_hashes(head.examples("train"))
    chosen = ExampleOrder(len(hashes), job.train.batch_size, job.train.seed).indices(1)
    m = job.train.micro_batches
    return [Batch("train", 1, k, ids=hashes[chosen[k::m]], indices=list(chosen[k::m])) for k in range(m)]


def _split_pass(stages: list[Stage], batches: list[Batch]) -> float:
    total = 0.0
    for batch in batches:
        sent, leaves, outs = {}, [], []
        for k, stage in enumerate(stages):
            here = batch if k == 0 else Batch("train", 1, batch.micro_batch, ids=batch.ids)
            inputs = {n: t.detach().requires_grad_() if t.is_floating_point() else t.detach() for n, t in sent.items()}
            out = stage.forward(here, inputs)
            _check_ports(stage, out.tensors, len(batch.ids))
            leaves.append(inputs)
            outs.append(out)
            sent = out.tensors
        loss = outs[-1].loss / len(batches)
        total += float(loss.detach())
        loss.backward()
        for k in range(len(stages) - 2, -1, -1):  # each part's boundary gradients back to the part before
            pairs = [(t, leaves[k + 1][n].grad) for n, t in outs[k].tensors.items()
                     if t.requires_grad and leaves[k + 1][n].grad is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return total


def _check_ports(stage: Stage, tensors: dict[str, torch.Tensor], batch: int) -> None:
    _, outputs = type(stage).ports(stage.context.job, stage.context.name)
    for port in outputs:
        why = port.accepts(tensors[port.name], batch) if port.name in tensors else "missing"
        if why:
            raise StageError(f"stage {stage.context.name}: boundary tensor {port.name!r}: {why}")


def _unsplit_pass(job: Any, stages: list[Stage], batches: list[Batch], options: Any) -> tuple[float, dict]:
    model = build_model(options.model, base_dir(job)).to(stages[0].device)
    model.train()
    loss_fn, data, total = loss_function(options.loss), stages[-1].data, 0.0
    for batch in batches:
        rows = batch.indices
        inputs = {k: v.to(stages[0].device) for k, v in stages[0].data.inputs("train", rows).items()}
        targets = data.targets("train", data.lookup("train", batch.ids)).to(stages[0].device)
        loss = checked(loss_fn, options.loss, model(**inputs), targets) / len(batches)
        total += float(loss.detach())
        loss.backward()
    return total, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def compare(split_loss: float, whole_loss: float, split_grads: dict, whole_grads: dict, stages: list[Stage],
            chain: list[str]) -> dict[str, Any]:
    odd = sorted(set(whole_grads) ^ set(split_grads))
    if odd:
        raise StageError(f"the parts' parameters are not the model's: {odd[:3]} are in one and not the other")
    worst, worst_name = 0.0, ""
    for name, want in whole_grads.items():
        scale = float(want.abs().max()) or 1.0  # a gradient of zeros: the difference itself
        diff = float((split_grads[name] - want).abs().max()) / scale
        if diff >= worst:
            worst, worst_name = diff, name
    loss_diff = abs(split_loss - whole_loss)
    return {"loss_split": split_loss, "loss_unsplit": whole_loss, "loss_diff": loss_diff,
            "max_rel_grad_diff": worst, "worst_parameter": worst_name.removeprefix(PREFIX),
            "parameters": len(whole_grads), "elements": sum(g.numel() for g in whole_grads.values()),
            "parts": [{"stage": name, "parameters": sum(p.numel() for p in s.trainable().values()),
                       "receives": [b.describe() for b in s.part.receives],
                       "sends": [b.describe() for b in s.part.sends]} for name, s in zip(chain, stages)],
            "ok": loss_diff <= LOSS_TOLERANCE * max(1.0, abs(whole_loss)) and worst <= GRAD_TOLERANCE}
