"""Is the job's split of the GPT into stages one model? Checked by every GPT stage before it builds
anything, over the whole job file, so a bad split fails each stage alike with a ConfigError naming the
stage to fix (`nebula stage run` exits 3 on it: no supervisor restarts a stage that cannot work).

- The GPT stages form one chain: a first stage (embeddings) at its head, a last (head and loss) at its
  end, middle stages between, one link from each to the next.
- They agree on the model: vocab_size, d_model, n_head, n_layer, seq_len.
- Their `layers` cover 0..n_layer exactly, in chain order: no layer held twice, none held by no stage.
- Both ends of each link agree on the width of what crosses it (d_model, or the bottleneck's k).
"""
from __future__ import annotations

from typing import Any

from nebula.errors import ConfigError
from nebula.runtime.registry import resolve_stage

MODEL_KEYS = ("vocab_size", "d_model", "n_head", "n_layer", "seq_len")


def check_split(job: Any, roles: dict[type, str]) -> list[str]:
    """The GPT stages of `job` in chain order, or a ConfigError. `roles`: stage class -> "first",
    "middle", "last" or "whole" (the GPT stage classes, handed in: this module imports none)."""
    kinds = {name: roles.get(resolve_stage(stage.impl)) for name, stage in job.stages.items()}
    chain = _chain(job, {n for n, kind in kinds.items() if kind}, kinds)
    options = {name: job.stages[name].options for name in chain}
    head = chain[0]
    for name in chain:
        _check_model(name, options[name])
        for key in MODEL_KEYS:
            if getattr(options[name], key) != getattr(options[head], key):
                raise ConfigError(f"[stages.{name}].{key} = {getattr(options[name], key)} but [stages.{head}] has "
                                  f"{getattr(options[head], key)}: every stage of one GPT must agree on {key}")
    _check_layers(chain, options)
    _check_links(job, chain, options)
    return chain


def _chain(job: Any, gpt: set[str], kinds: dict[str, str | None]) -> list[str]:
    """The GPT stages from the first to the last, following the job's links."""
    firsts = [n for n in job.stages if kinds[n] in ("first", "whole")]
    if len(firsts) != 1:
        raise ConfigError(f"a GPT job has exactly one first stage (impl gpt-first, or gpt-whole); this one has "
                          f"{len(firsts)}: {', '.join(firsts) or 'none'}")
    chain = [firsts[0]]
    while kinds[chain[-1]] not in ("last", "whole"):
        outs = [link.dst for link in job.graph.out_links[chain[-1]] if link.dst in gpt]
        if len(outs) != 1:
            raise ConfigError(f"stage {chain[-1]} ({kinds[chain[-1]]} GPT stage) must feed exactly one GPT stage "
                              f"by a [[links]] entry; it feeds {', '.join(outs) or 'none'}")
        if outs[0] in chain or kinds[outs[0]] in ("first", "whole"):
            raise ConfigError(f"stage {outs[0]} cannot follow {chain[-1]}: the chain must end at a gpt-last stage")
        chain.append(outs[0])
    stray = sorted(gpt - set(chain))
    if stray:
        raise ConfigError(f"stage {stray[0]} is a GPT stage off the chain {' -> '.join(chain)}: link it into the "
                          "chain or remove it")
    return chain


def _check_model(name: str, o: Any) -> None:
    if o.d_model % o.n_head or (o.d_model // o.n_head) % 2:
        raise ConfigError(f"[stages.{name}]: d_model {o.d_model} / n_head {o.n_head} must be an even whole number "
                          "(the rotary embedding turns pairs of each head's dimensions)")
    if len(o.layers) != 2:
        raise ConfigError(f"[stages.{name}].layers = {list(o.layers)}: give [first, last), the blocks this stage "
                          f"holds, e.g. [0, {o.n_layer // 2}]")


def _check_layers(chain: list[str], options: dict[str, Any]) -> None:
    n_layer, expected = options[chain[0]].n_layer, 0
    for name in chain:
        first, last = options[name].layers
        if not first < last <= n_layer:
            raise ConfigError(f"[stages.{name}].layers = [{first}, {last}]: the blocks [first, last) must hold at "
                              f"least one of the model's layers 0..{n_layer - 1} (n_layer = {n_layer})")
        if first > expected:
            raise ConfigError(f"[stages.{name}].layers = [{first}, {last}]: layers {expected}..{first - 1} are held "
                              f"by no stage; start it at {expected}")
        if first < expected:
            raise ConfigError(f"[stages.{name}].layers = [{first}, {last}]: layers {first}..{expected - 1} are "
                              f"also held by the stage before it; start it at {expected}")
        expected = last
    if expected != n_layer:
        raise ConfigError(f"[stages.{chain[-1]}].layers ends at {expected} but n_layer = {n_layer}: layers "
                          f"{expected}..{n_layer - 1} are held by no stage")


def _check_links(job: Any, chain: list[str], options: dict[str, Any]) -> None:
    for src, dst in zip(chain, chain[1:]):
        link = job.graph.link(f"{src}->{dst}")
        if not link.backward:
            raise ConfigError(f"[[links]] {link.name}: backward = true is required: the activations' gradients "
                              "train the stages before it")
        sent, expected = width(options[src]), width(options[dst])
        if sent != expected:
            raise ConfigError(f"stage {dst}: its link from {src} would carry (B, T, {sent}) but {dst} expects "
                              f"(B, T, {expected}); set the same bottleneck at both ends "
                              f"([stages.{src}] and [stages.{dst}])")
    for name in chain:
        o = options[name]
        if o.tie_embeddings and len(chain) > 1:
            raise ConfigError(f"[stages.{name}].tie_embeddings: the embedding and the head are at different "
                              "stages here; tying needs one stage holding both (gpt-whole)")


def width(options: Any) -> int:
    """The last dimension of what a stage's boundary links carry."""
    return options.bottleneck or options.d_model
