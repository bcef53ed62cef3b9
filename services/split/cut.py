"""Cut a model at its split points with torch's own splitter, and find what crosses each cut.

    export      torch.export traces the whole model (its forward as one graph, batch of the job's
                micro-batch); torch.distributed.pipelining splits the graph where `pipe_split` markers
                sit (`SplitPoint.BEGINNING` of each point's module) into one GraphModule per part, each
                holding its own parameters under their original names.
    sequential  the fallback for a torch.nn.Sequential that torch.export cannot trace: the points name
                children of the container; a part runs its children in order; one tensor crosses.

Boundary values are what a part uses that an earlier part computed: the runtime's ports. A value an
earlier part computed and a later part uses, past the next one (GPT-2's causal mask, made once and used
in every block), is relayed by the parts between. Model inputs (the token ids, a mask) are not sent:
each part that uses one reads it from its own copy of the data, by example id.

Everything a cut cannot carry is a ConfigError naming the point, before any stage starts: a point that
names no module, runs twice or never, or out of forward order; parameters used on both sides of a cut
(tied weights) or by no part; a value crossing a cut that is not a tensor with the batch first, or of
a dtype the wire does not carry.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx, nn

from nebula.errors import ConfigError, StageError
from nebula.runtime.stage import FLOAT, Port
from nebula.wire import ITEMSIZE
from services.split.model import Logits, close_match

PREFIX = "model."  # the wrapper's attribute: a user's point "transformer.h.6" is "model.transformer.h.6" here
# ops whose result depends on train() / eval(): a model that has them is traced once in each mode
MODE_OPS = {"aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default",
            "aten.alpha_dropout.default", "aten.feature_alpha_dropout.default", "aten.batch_norm.default",
            "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit_functional.default",
            "aten.rrelu_with_noise.default"}


@dataclass(frozen=True)
class Boundary:
    """One tensor crossing a cut, as traced (batch first)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def port(self) -> Port:
        dtype = FLOAT if self.dtype.is_floating_point else str(self.dtype).removeprefix("torch.")
        return Port(self.name, dtype, rank=len(self.shape), role="activation" if dtype == FLOAT else "tensor")

    def describe(self) -> str:
        return f"{self.name} {str(self.dtype).removeprefix('torch.')} (B, {', '.join(map(str, self.shape[1:]))})"


@dataclass
class Part:
    """One slice of the model: its module, and where each of its arguments comes from."""

    index: int
    module: nn.Module
    args: list[tuple[str, str]]  # per argument: ("input", model input name) or ("boundary", boundary name)
    receives: tuple[Boundary, ...]  # what crosses the cut before it
    sends: tuple[Boundary, ...]  # what crosses the cut after it (its own results, then relays)
    produces: dict[str, int | None] = field(default_factory=dict)  # boundary name -> its output index
    mode_dependent: bool = False  # its graph has MODE_OPS: inference needs a twin traced in eval mode
    eval_module: nn.Module | None = None  # that twin, sharing the parameters (trace_eval)

    @property
    def inputs(self) -> list[str]:
        """The model inputs this part reads from its own data."""
        return [name for kind, name in self.args if kind == "input"]

    def run(self, received: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
            training: bool = True) -> dict[str, torch.Tensor] | torch.Tensor:
        """Its boundary tensors for the next part (or, the last part, the model's output)."""
        if not training and self.mode_dependent and self.eval_module is None:
            raise StageError(f"part {self.index} acts differently in training: trace its eval twin first (trace_eval)")
        module = self.module if training or self.eval_module is None else self.eval_module
        values = [local[name] if kind == "input" else received[name] for kind, name in self.args]
        out = module(*values)
        if not self.sends:
            return out[0] if isinstance(out, tuple) else out
        sent = {}
        for b in self.sends:
            if b.name not in self.produces:
                # relayed: it leaves as a view, so that its gradient from downstream flows back into the
                # tensor received (and on to the part that made it) through autograd, like any other
                sent[b.name] = received[b.name].view_as(received[b.name])
            else:
                index = self.produces[b.name]
                sent[b.name] = out if index is None else out[index]
        return sent


def split(model: Logits, example: dict[str, torch.Tensor], points: tuple[str, ...], splitter: str) -> list[Part]:
    """The parts of `model` cut at `points` (names of modules of the wrapped model), traced on `example`
    (the model's inputs for one micro-batch)."""
    _check_points_exist(model, points)
    batch = next(iter(example.values())).shape[0]
    if splitter == "sequential":
        parts = _sequential(model, example, points)
        _check_batch_first(parts, batch, points)
        return parts
    parts = _exported(model, example, points)
    _check_batch_first(parts, batch, points)
    for part in parts:
        part.mode_dependent = _mode_dependent(part)
    return parts


def trace_eval(part: Part, model: Logits, example: dict[str, torch.Tensor], points: tuple[str, ...]) -> None:
    """Give `part` its twin traced in eval mode (dropout off, batch norm's running statistics), cut from
    `model` built again as at first, sharing `part`'s own parameters and buffers, so that it sees every
    update: what inference runs where the graph acts differently in training (Part.mode_dependent)."""
    model.eval()
    twin = _exported(model, example, points)[part.index]
    part.eval_module = _sharing(twin.module, part.module)


def _check_points_exist(model: Logits, points: tuple[str, ...]) -> None:
    names = [n.removeprefix(PREFIX) for n, _ in model.named_modules() if n.startswith(PREFIX)]
    for point in points:
        if point not in names:
            raise ConfigError(f"split point {point!r} names no module of {type(model.model).__name__}"
                              f"{close_match(point, names)}; points are module names as named_modules() gives them")
    if len(set(points)) != len(points):
        raise ConfigError(f"split points {list(points)}: a point is listed twice")


# -- export ------------------------------------------------------------------------------------------
def _exported(model: Logits, example: dict[str, torch.Tensor], points: tuple[str, ...]) -> list[Part]:
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe

    with _markers(model, points):
        try:
            program = torch.export.export(model, (), example)
        except Exception as exc:  # noqa: BLE001 - export fails in many ways; the user needs the first line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(f"torch.export cannot trace {type(model.model).__name__} as one graph "
                              f"({type(exc).__name__}: {first[:300]}): data-dependent control flow or an "
                              "untraceable call; for a torch.nn.Sequential set model.splitter = \"sequential\" "
                              "(docs/model.md, \"What cannot be split\")") from exc
    _check_marker_order(program.graph, points)
    pipe = Pipe._from_traced(model, program, MultiUseParameterConfig.REPLICATE)
    if pipe.num_stages != len(points) + 1:
        raise ConfigError(f"split points {list(points)} make {pipe.num_stages} parts, not {len(points) + 1}: two "
                          "points with nothing computed between them; drop one")
    parts = _parts(pipe.split_gm, points)
    _check_owners(model, parts, points)
    return parts


@contextlib.contextmanager
def _markers(model: nn.Module, points: tuple[str, ...]) -> Iterator[None]:
    """pipelining's pipe_split marker at the start of each point's module, removed again on the way out
    (annotate_split_points alone would stack a second marker on a second trace)."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import annotate_split_points

    annotate_split_points(model, {PREFIX + p: SplitPoint.BEGINNING for p in points})
    try:
        yield
    finally:
        for point in points:
            module = model.get_submodule(PREFIX + point)
            module.forward = module._orig_forward
            del module._orig_forward


def _check_marker_order(graph: fx.Graph, points: tuple[str, ...]) -> None:
    """Each point's marker ran once, in the order given."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    ran = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target == aten_pipe_split_alias:
            stack = list(node.meta.get("nn_module_stack", {}).values())
            ran.append(stack[-1][0].removeprefix(PREFIX) if stack else "?")
    for point in points:
        if ran.count(point) == 0:
            raise ConfigError(f"split point {point!r} never runs in the model's forward: no part would begin "
                              "there; name a module the forward calls")
        if ran.count(point) > 1:
            raise ConfigError(f"split point {point!r} runs {ran.count(point)} times in one forward (a module "
                              "used more than once): a cut there would cut the model in several places")
    if ran != list(points):
        raise ConfigError(f"split points must be in forward order: the model runs them as {ran}, not "
                          f"{list(points)}; write points = {ran}")


def _parts(root: fx.GraphModule, points: tuple[str, ...]) -> list[Part]:
    """The parts, their arguments' origins and the boundary values at each cut, from the root graph
    that calls the parts in turn."""
    calls = [n for n in root.graph.nodes if n.op == "call_module"]
    index = {node: k for k, node in enumerate(calls)}
    origin: dict[fx.Node, tuple[int, int | None]] = {}  # root value -> (part that made it, its output index)
    for node in root.graph.nodes:
        if node.op == "call_module":
            origin[node] = (index[node], None)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in index:
            origin[node] = (index[node.args[0]], node.args[1])
    names: dict[fx.Node, str] = {}
    boundaries: dict[fx.Node, Boundary] = {}
    used_by: dict[fx.Node, int] = {}  # value -> the last part that uses it
    args: list[list[tuple[str, str]]] = []
    for k, call in enumerate(calls):
        module = root.get_submodule(call.target)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        args.append([])
        for value, placeholder in zip(call.args, placeholders):
            if value.op == "placeholder":
                args[k].append(("input", value.target))
                continue
            if value not in names:  # named as its first user's graph names it ("add_7"), unique in the job
                taken = set(names.values())
                names[value] = placeholder.name if placeholder.name not in taken else f"{placeholder.name}_{k}"
                _check_carried(placeholder, names[value], points[origin[value][0]])
                val = placeholder.meta["val"]
                boundaries[value] = Boundary(names[value], val.dtype, tuple(int(d) for d in val.shape))
            used_by[value] = k
            args[k].append(("boundary", names[value]))
    output = next(n for n in root.graph.nodes if n.op == "output").args[0]
    final = output[0] if isinstance(output, (tuple, list)) else output
    if origin.get(final, (None,))[0] != len(calls) - 1:
        raise ConfigError(f"the model's output is not computed by its last part (after split point "
                          f"{points[-1]!r}): the last point cuts after the computation ends; drop it")
    parts = []
    for k, call in enumerate(calls):
        live_in = [v for v in names if origin[v][0] < k <= used_by[v]]
        live_out = [v for v in names if origin[v][0] <= k < used_by[v]]
        live_out.sort(key=lambda v: origin[v][0] != k)  # its own results first, then relays
        parts.append(Part(k, root.get_submodule(call.target), args[k], tuple(boundaries[v] for v in live_in),
                          tuple(boundaries[v] for v in live_out),
                          {names[v]: origin[v][1] for v in live_out if origin[v][0] == k}))
    return parts


def _check_carried(placeholder: fx.Node, name: str, point: str) -> None:
    """Whether the runtime can carry `value` across the cut at `point`: a tensor, batch first, a wire dtype."""
    val = placeholder.meta.get("val")
    after = f"the cut at split point {point!r} would carry {name!r}"
    if not isinstance(val, torch.Tensor):
        raise ConfigError(f"{after}, a {type(val).__name__} ({val!r}), not a tensor: move the point where only "
                          "tensors cross")
    dtype = str(val.dtype).removeprefix("torch.")
    if not val.is_floating_point() and dtype not in ITEMSIZE:
        raise ConfigError(f"{after} of dtype {dtype}, which the wire does not carry ({', '.join(sorted(ITEMSIZE))})")
    if not 1 <= val.dim() <= 8:
        raise ConfigError(f"{after} of shape {tuple(val.shape)}: a boundary tensor has the batch first and "
                          "at most 8 dimensions")


def _check_batch_first(parts: list[Part], batch: int, points: tuple[str, ...]) -> None:
    for part in parts[1:]:
        for b in part.receives:
            if b.shape[0] != batch:
                raise ConfigError(f"the cut at split point {points[part.index - 1]!r} would carry {b.describe()} "
                                  f"of shape {b.shape}, whose first dimension is not the batch ({batch}): the "
                                  "runtime carries per-example tensors; move the point")


def _check_owners(model: Logits, parts: list[Part], points: tuple[str, ...]) -> None:
    """Every trainable weight is held by exactly one part. Tied weights are one parameter under several
    names in the model; the parts keep the names, so a tie is found by name (on "meta" too)."""
    names: dict[str, str] = {}  # every name of a weight -> its first name
    firsts: dict[int, str] = {}
    for name, param in _all_named_parameters(model):
        names[name] = firsts.setdefault(id(param), name)
    owner: dict[str, tuple[int, str]] = {}  # a weight's first name -> (part, the name it has there)
    for part in parts:
        for name, _ in _all_named_parameters(part.module):
            first = names.get(name, name)
            if first in owner and owner[first][0] != part.index:
                k, other = owner[first]
                shown = ", ".join(sorted({first, other, name})).replace(PREFIX, "")
                raise ConfigError(f"weight {shown} (one parameter) is used on both sides of split point "
                                  f"{points[part.index - 1]!r} (by parts {k} and {part.index}; tied weights, e.g. an "
                                  "output head sharing the input embedding): each site would train a copy of its "
                                  "own; untie it (transformers: overrides = {tie_word_embeddings = false}) or keep "
                                  "its users in one part")
            owner.setdefault(first, (part.index, name))
    for name, param in model.named_parameters():
        if param.requires_grad and names[name] not in owner:
            module = name.removeprefix(PREFIX).rpartition(".")[0]
            raise ConfigError(f"module {module!r} holds weights ({name.removeprefix(PREFIX)}) that no part uses: "
                              "the model's forward never reads them, so no stage would own or train them; "
                              "remove the module from the model or make the forward use it")


def _all_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters(remove_duplicate=False))


def _mode_dependent(part: Part) -> bool:
    """Whether a traced part has an op that acts differently in training (dropout with p > 0, batch norm)."""
    for module in part.module.modules():
        for node in getattr(module, "graph", fx.Graph()).nodes:
            if node.op == "call_function" and str(node.target) in MODE_OPS:
                p = node.args[1] if len(node.args) > 1 and "dropout" in str(node.target) else None
                if p != 0.0:
                    return True
    return False


def _sharing(twin: nn.Module, module: nn.Module) -> nn.Module:
    """`twin` with `module`'s parameters and buffers themselves, so that it sees every update."""
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, tensor in list(twin.named_parameters()) + list(twin.named_buffers()):
        if name in own:
            parent, _, leaf = name.rpartition(".")
            holder = twin.get_submodule(parent) if parent else twin
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(leaf, own[name])
            else:
                holder.register_buffer(leaf, own[name])
    return twin


# -- sequential ----------------------------------------------------------------------------------------
class _Children(nn.Sequential):
    """Children [first, last) of a torch.nn.Sequential, under their names in it."""


def _sequential(model: Logits, example: dict[str, torch.Tensor], points: tuple[str, ...]) -> list[Part]:
    container = model.model
    if not isinstance(container, nn.Sequential):
        raise ConfigError(f"model.splitter = \"sequential\" cuts a torch.nn.Sequential; "
                          f"{type(container).__name__} is not one (use splitter = \"export\")")
    if len(example) != 1:
        raise ConfigError(f"a torch.nn.Sequential takes one input, but the data gives {sorted(example)}")
    names = [n for n, _ in container.named_children()]
    bad = [p for p in points if p not in names]
    if bad:
        raise ConfigError(f"split point {bad[0]!r} is not a child of the torch.nn.Sequential (its children: "
                          f"{', '.join(names)}); with splitter = \"sequential\" the points name children")
    starts = [0, *[names.index(p) for p in points], len(names)]
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise ConfigError(f"split points {list(points)} must name children in order, each after the last")
    (input_name, x), = example.items()
    parts, received = [], ()
    for k, (a, b) in enumerate(zip(starts, starts[1:])):
        module = _Children()
        for name in names[a:b]:
            module.add_module(name, container.get_submodule(name))
        with torch.no_grad():
            x = module(x)
        sends = (Boundary(f"cut{k + 1}", x.dtype, tuple(x.shape)),) if k < len(points) else ()
        args = [("input", input_name)] if k == 0 else [("boundary", received[0].name)]
        parts.append(Part(k, _Prefixed(module), args, received, sends, {b.name: None for b in sends}))
        received = sends
    for part in parts[1:]:
        _check_carried_tensor(part.receives[0], points[part.index - 1])
    return parts


class _Prefixed(nn.Module):
    """A part's children under the names they have in the whole model ("model.3.weight")."""

    def __init__(self, children: nn.Module):
        super().__init__()
        self.model = children

    def forward(self, *args: Any) -> torch.Tensor:
        return self.model(*args)


def _check_carried_tensor(boundary: Boundary, point: str) -> None:
    dtype = str(boundary.dtype).removeprefix("torch.")
    if not boundary.dtype.is_floating_point and dtype not in ITEMSIZE:
        raise ConfigError(f"the cut at split point {point!r} would carry {boundary.describe()}, a dtype the wire "
                          f"does not carry")
