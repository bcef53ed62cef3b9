"""A backward in two halves (nebula.runtime.split_backward): the input gradient first, the weights' later,
each the same bit for bit as one backward pass's, for the live weights and for a stash of them; a
stage where a weight reaches the outputs around its inputs keeps the one-pass backward."""
import copy

import torch

from nebula.runtime import split_backward


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"layer": torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                "head": torch.nn.Linear(32, 5)})


def run(module, split: bool, micro_batches: int = 3, params=None):
    """Backward of a middle stage (an output the next stage sends a gradient for) and a sink (a loss),
    accumulated over micro-batches, -> (input gradients, weight gradients)."""
    torch.manual_seed(1)
    params = dict(module.named_parameters()) if params is None else params
    inputs = []
    for _ in range(micro_batches):
        x = torch.randn(4, 6, 32).requires_grad_()
        layer = {k.removeprefix("layer."): v for k, v in params.items() if k.startswith("layer.")}
        h = torch.func.functional_call(module["layer"], layer, (x,))  # (B, T, H)
        loss = torch.nn.functional.linear(h, params["head.weight"], params["head.bias"]).square().mean()
        out, given = h[:, :3], torch.randn(4, 3, 32)  # a view: what a stage may well send
        roots, grads = [loss, out], [None, given]
        if split:
            dx, weight_half = split_backward.backward_input(roots, grads, [x], list(params.values()))
            weight_half()
        else:
            torch.autograd.backward(roots, [torch.ones_like(loss), given])
            dx = [x.grad]
        inputs.append(dx[0])
    return inputs, [p.grad for p in params.values()]


def test_the_two_halves_equal_one_backward_bit_for_bit():
    whole, halves = run(block(), split=False), run(block(), split=True)
    assert all(torch.equal(a, b) for a, b in zip(whole[0], halves[0]))
    assert all(torch.equal(a, b) for a, b in zip(whole[1], halves[1]))


def test_the_halves_work_on_a_stash_of_the_weights():
    """one-step-stale runs a step at a copy of the weights (plain leaf tensors, not Parameters)."""
    module = block()
    stash = {k: p.detach().clone().requires_grad_() for k, p in module.named_parameters()}
    live = copy.deepcopy(module)
    _, from_stash = run(module, split=True, params=stash)
    _, from_live = run(live, split=False)
    assert all(torch.equal(a, b) for a, b in zip(from_stash, from_live))
    assert all(p.grad is None for p in module.parameters())  # the live weights were not touched


def test_a_weight_that_reaches_the_outputs_around_the_inputs_keeps_the_one_pass_backward():
    layer, bias = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.zeros(()))
    x = torch.randn(2, 4).requires_grad_()
    through = layer(x).sum()
    assert split_backward.exact([through], [x], list(layer.parameters()))
    around = bias * 3.0  # a second output that never sees x: torch's weight half would miss `bias`
    assert not split_backward.exact([through, around], [x], [*layer.parameters(), bias])
