"""A micro-batch's backward in two halves, input gradient first (zero-bubble pipelines, Qi et al. 2023).

The stage that sends gradients back computes the gradient of its inputs, sends it, and computes its
weights' gradient later, in time it would otherwise spend waiting: the peer upstream no longer waits
for this stage's weight gradient. The halves are torch.distributed.pipelining's own
(`stage_backward_input` keeps the gradients at the autograd nodes where the weights' subgraphs join
the inputs' path, `stage_backward_weight` starts from them), so nothing is computed twice and every
gradient is the same, bit for bit, as one backward pass's (tests/unit/test_split_backward.py).

That holds where every weight that took part reaches the outputs through the inputs' path; a weight
that reaches them only some other way (an output that does not depend on the inputs at all) would get
no gradient from torch's second half, so such a stage keeps the one-pass backward (`exact`).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Sequence

import torch


def _halves() -> ModuleType:
    # why here: importing torch.distributed.pipelining costs 1.2 s of CPU on a 2-core AVX2 machine (it imports
    # torch._dynamo, which torch.optim imports too): at start, every process that imports the runtime paid it,
    # those that build no optimizer (evaluations, translation, the demos' own processes) for nothing
    from torch.distributed.pipelining import _backward
    return _backward


def _nodes(tensors: Sequence[torch.Tensor]) -> list:
    node = _halves()._get_grad_fn_or_grad_acc
    return [n for n in (node(t) for t in tensors if t.requires_grad) if n is not None]


def exact(roots: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether the two halves give every weight that took part its gradient (see the module's docstring)."""
    reverse = _halves().construct_reverse_graph(_nodes(roots))
    weights = [n for n in _nodes(params) if n in reverse]  # the weights this backward reaches
    groups = _halves().get_param_groups(_nodes(leaves), weights, reverse)
    covered = set().union(*(group["params"] for group in groups)) if groups else set()
    return set(weights) <= covered


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The gradients of `leaves` for `roots` (given `grads`: None for a scalar loss), and the second half,
    which puts the weights' gradients on `params` (accumulated, as a backward pass does)."""
    ones = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    # torch detaches the roots in place when it is done, which a view refuses: a copy of such a root then
    roots = [r.clone() if r._is_view() else r for r in roots]
    weights: Any = params  # torch types them as Parameters; a stash's leaves (one-step-stale) work alike
    dinputs, groups = _halves().stage_backward_input(roots, ones, list(leaves), iter(weights))

    def weight_half() -> None:
        _halves().stage_backward_weight(iter(weights), groups)
    return [d if d is not None else torch.zeros_like(leaf) for d, leaf in zip(dinputs, leaves)], weight_half
