"""A link's compression as the runtime uses it: the job's policy (nebula.codecs.CompressionPolicy,
phases of a fixed codec or `auto` per direction), `auto` resolved to a ladder's rung before anything
is encoded (nebula.runtime.autocodec), per-tensor codec state, byte meters.

"forward" is the link's direction (activations, from -> to), "backward" the gradients coming back
on a two-way link. Every message names its codec, so the receiver needs no word of the policy.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from nebula import codecs
from nebula.codecs.auto import SYNC_HEADROOM, Auto
from nebula.runtime.autocodec import AutoChoice
from nebula.transport.goodput import Goodput
from nebula.wire import TensorPayload

ROLES = {"forward": "activation", "backward": "gradient"}
COMPUTE_STEPS = 5  # `auto` takes the sender's compute per step as the median of the last few
DIRECTIONS = {role: direction for direction, role in ROLES.items()}


class LinkMeter:
    """One JSON line per packed tensor (step, direction, codec, raw and wire bytes, encode seconds),
    keyed by the step the tensor belongs to, so per-step sums never race with the sender thread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def record(self, **fields: Any) -> None:
        self._file.write(json.dumps({"t": round(time.time(), 4), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


class LinkCodecs:
    """Packs tensors for one link (e.g. src->sink), both directions; keeps the sender-side codec
    state (error-feedback residuals, low-rank warm starts), which checkpoints save and resumes restore,
    and the receiver-side state of `delta` streams (their cached rows), which a resume empties at both
    ends instead (see load_state_dict)."""

    def __init__(self, policy: codecs.CompressionPolicy, link: str, meter: LinkMeter | None = None,
                 spill_dir: str | Path | None = None):
        self.policy, self.link, self.meter = policy, link, meter
        self.spill_dir = spill_dir  # where `delta(..., ram=)` spills cached rows: the stage's run directory
        self.state = codecs.CodecState()
        self.received = codecs.CodecState()  # receiver side: one slot per (link:direction, tensor)
        self._bytes: Counter = Counter()
        self.raw_bytes: Counter = Counter()
        self._meter_lock = threading.Lock()  # pack runs on sender threads, take_bytes on the stage's
        self.auto: dict[str, AutoChoice] = {}  # direction -> its `auto` choice, where the policy says "auto"
        self._goodput: Callable[[str, int], Goodput | None] = lambda direction, size: None
        self._on_switch: Callable[..., None] = lambda **event: None
        self._default_headroom = SYNC_HEADROOM  # unattached, nothing is measured and auto stays on its first rung
        self._compute: deque[float] = deque(maxlen=COMPUTE_STEPS)  # the sending stage's recent compute_s

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | str, link: str, meter_path: str | Path | None = None,
                   spill_dir: str | Path | None = None) -> LinkCodecs:
        """From a job's [links.compression] table (or "auto"); meter lines go to `meter_path`."""
        return cls(codecs.read_policy(table), link, LinkMeter(meter_path) if meter_path else None, spill_dir)

    def attach(self, goodput: Callable[[str, int], Goodput | None], on_switch: Callable[..., None],
               default_headroom: float) -> None:
        """What `auto` goes by: the goodput of the path each direction's messages take (by direction and
        message size, nebula.transport.goodput), who hears of every switch (keyword fields, see
        AutoChoice._decide), and the headroom where the job sets none (the schedule's default_headroom)."""
        self._goodput, self._on_switch, self._default_headroom = goodput, on_switch, default_headroom

    def observe_step(self, compute_s: float) -> None:
        """The sending stage's compute in the step it just applied (for `auto`)."""
        self._compute.append(compute_s)

    def _compute_s(self) -> float | None:
        recent = list(self._compute)  # appended on the stage's thread, read on the sender's
        return statistics.median(recent) if recent else None

    def _resolve(self, direction: str, name: str, tensor: torch.Tensor,
                 step: int) -> tuple[codecs.Codec, AutoChoice | None]:
        """The codec to encode with: the policy's, or where it says `auto` the rung in force."""
        chosen = self.policy.codec_for(direction, name, tensor.numel(), step, dtype=tensor.dtype)
        if not isinstance(chosen, Auto):
            return chosen, None
        choice = self.auto.get(direction)
        # first use, or a phase with other settings; a later phase with the same ones goes on from its rung
        if choice is None or choice.settings != chosen:
            choice = self.auto[direction] = AutoChoice(self.link, direction, chosen,
                                                       lambda size: self._goodput(direction, size),
                                                       self._compute_s, self._switched, self._default_headroom)
        return choice.codec(step, name, tensor), choice

    def _switched(self, **event: Any) -> None:
        if self.meter:
            self.meter.record(kind="auto", **event)
        self._on_switch(**event)

    def pack(self, direction: str, name: str, tensor: torch.Tensor, step: int,
             ids: torch.Tensor | None = None, split: str | None = None) -> TensorPayload:
        """`ids`: the (B,) example-id hashes of the tensor's rows, for `delta` (None on gradients);
        `split`: the split an inference pass evaluates (None: training), named in link.jsonl so that
        a training ratio leaves out the evaluation's bytes (for `delta` they are all first visits)."""
        tensor = tensor.detach().cpu()  # the wire carries CPU frames; a no-op for CPU tensors
        # token ids and masks get the link's codec only if it is exact (deflate), else go as they are
        codec, choice = self._resolve(direction, name, tensor, step)
        started = time.perf_counter()
        payload = codecs.pack(name, ROLES.get(direction, direction), tensor.contiguous(), codec,
                              state=(slot := self.state.slot(f"{self.link}:{direction}", name)), ids=ids,
                              spill_dir=self.spill_dir)
        encode_s = time.perf_counter() - started
        raw = tensor.numel() * tensor.element_size()
        with self._meter_lock:
            self._bytes[direction] += payload.wire_bytes
            self.raw_bytes[direction] += raw
        if choice is not None:
            choice.observe_pack(codec, name, tensor, raw, payload.wire_bytes)
        if self.meter:
            extra = {"cache": slot["cache"].stats()} if "cache" in slot else {}  # delta: hits, misses, bytes
            if split is not None:
                extra["split"] = split
            if choice is not None:
                extra["auto"] = True
            self.meter.record(step=step, link=self.link, dir=direction, name=name, codec=str(codec), raw=raw,
                              wire=payload.wire_bytes, encode_s=round(encode_s, 6), **extra)
        return payload

    def unpack(self, payload: TensorPayload) -> torch.Tensor:
        direction = DIRECTIONS.get(payload.role, payload.role)
        return codecs.unpack(payload, state=self.received.slot(f"{self.link}:{direction}", payload.name),
                             spill_dir=self.spill_dir)

    def state_dict(self) -> dict[str, Any]:
        """The sender's codec state without `delta` streams: their caches are not checkpointed."""
        saved = self.state.state_dict()
        return {"slots": [s for s in saved["slots"] if not str(s[2].get("spec", "")).startswith("delta(")]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Replace the codec state (the sender must not be packing: see BackgroundSender.discard).
        Every site restores at a resume, so both ends of every `delta` stream start empty together
        (first visits then go direct), whatever messages the abandoned generation had in flight."""
        state = codecs.CodecState()
        state.load_state_dict(saved)
        self.state, self.received = state, codecs.CodecState()

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """`delta` caches, sender's and receiver's, by "send|recv link:direction/tensor": hits, misses,
        evictions, entries, bytes, cap_bytes."""
        out = {}
        for side, state in (("send", self.state), ("recv", self.received)):
            for link, name, slot in state.state_dict()["slots"]:
                if "cache" in slot:
                    out[f"{side} {link}/{name}"] = slot["cache"].stats()
        return out

    def take_bytes(self, direction: str) -> int:
        """Wire bytes sent in `direction` since the last call."""
        with self._meter_lock:
            return self._bytes.pop(direction, 0)
