"""`compression = "auto"`: per link and direction, the least lossy rung of a ladder whose wire time
hides under compute, re-decided as the link changes (docs/codecs.md, "auto").

The sender of a direction decides alone, from what it measures itself:
- the path's goodput, from the ACK timing of its own messages (nebula.transport.goodput), for
  messages of each rung's size (small ones pass a token bucket at once and read faster);
- its compute per training step (the runner's `compute_s`): while the wire of step t takes less
  than the sender spends computing, the transfer overlaps the compute and the step does not wait;
- the wire bytes per step of every rung: the bytes it sent last step, scaled per tensor by each
  rung's ratio (measured on the last tensor of that name, a trial encode off the compute path).

It takes the first rung with predicted wire <= headroom x compute (the last rung if none does), and
looks again every `every` steps. Moving to a less lossy rung needs the stricter bound
`RELAX x headroom x compute`, so a rung at the edge does not flap.

A new connection reads slow: the first ACKs come while TCP is still starting up (measured at
60 Mbit/s and 80 ms RTT: 12.8 Mbit/s after one step, 35 after five), and a decision on them sent the
forward to fp16 on a link that was not the bottleneck. Until the meter holds SAMPLES ACKs, auto
therefore acts only on an unmistakable bottleneck, the rung in force predicted slower on the wire
than the step's compute (waiting would cost more than a wrong guess, which the next look corrects),
and it looks again as soon as the meter is warm, not `every` steps later. Every message names its codec, so
the receiver follows without being told; each switch is a `compression` event in the stage's
metrics and a line in link.jsonl. One-site links (no measured goodput) stay on the first rung.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from nebula import codecs
from nebula.codecs.auto import AutoSettings
from nebula.codecs.base import Codec
from nebula.transport.goodput import SAMPLES, Goodput

RELAX = 0.8  # going back to a less lossy rung needs this much more room


class AutoChoice:
    """The rung in force for one (link, direction); runs on the sender thread. `goodput(message_bytes)`:
    the path's (None: nothing measured, stay on the first rung); `compute()`: the sender's s/step."""

    def __init__(self, link: str, direction: str, settings: AutoSettings, goodput: Callable[[int], Goodput | None],
                 compute: Callable[[], float | None], on_switch: Callable[..., None]):
        self.link, self.direction, self.settings = link, direction, settings
        self.ladder = settings.ladder(direction)
        self.goodput, self.compute, self.on_switch = goodput, compute, on_switch
        self.rung, self.step, self.decided_at, self.warm = 0, 0, None, False
        self.raw: Counter = Counter()  # this step's raw bytes per tensor name
        self.packs: Counter = Counter()  # ... and how many tensors of that name (one per message)
        self.messages = 1  # messages in the last whole step
        self.last_raw: Counter = Counter()  # the last whole step's
        self.samples: dict[str, torch.Tensor] = {}  # name -> its last tensor, for trial encodes
        self.ratios: dict[tuple[str, str, tuple], float] = {}  # (codec, name, shape) -> wire / raw

    def codec(self, step: int, name: str, tensor: torch.Tensor) -> Codec:
        if step != self.step:  # a new step: last step's bytes are complete
            if self.raw:
                self.last_raw, self.messages = self.raw, max(self.packs.values())
            self.step, self.raw, self.packs = step, Counter(), Counter()
            due = self.decided_at is None or not self.warm or step - self.decided_at >= self.settings.every
            if due and self._decide(step):  # a cold meter looks every step, so the first warm one looks
                self.decided_at = step
        self.raw[name] += tensor.numel() * tensor.element_size()
        self.packs[name] += 1
        self.samples[name] = tensor
        return self.ladder[self.rung]

    def observe_pack(self, codec: Codec, name: str, tensor: torch.Tensor, raw: int, wire: int) -> None:
        self.ratios[(codec.spec, name, tuple(tensor.shape))] = wire / max(raw, 1)

    def _decide(self, step: int) -> bool:
        """Take the rung that fits now; False while there is nothing to go by (stay, and look next step)."""
        compute, measured = self.compute(), self.goodput(0)
        if compute is None or measured is None or not self.last_raw:
            return False
        self.warm = measured.samples >= SAMPLES
        wires, rates = [], []
        for codec in self.ladder:  # each rung's step bytes at the goodput of messages of its size
            step_bytes = self._wire_bytes(codec)
            rate = self.goodput(int(step_bytes / self.messages)).bytes_per_s
            wires.append(step_bytes / rate if rate else 0.0)
            rates.append(rate)
        if not self.warm and wires[self.rung] <= compute:
            return False  # still starting up and not clearly the bottleneck: wait for a warm meter
        budget = self.settings.headroom * compute
        fits = [i for i, w in enumerate(wires) if w <= (budget if i >= self.rung else RELAX * budget)]
        chosen = fits[0] if fits else len(self.ladder) - 1
        if chosen != self.rung:
            before, self.rung, rate = self.ladder[self.rung], chosen, rates[chosen]
            self.on_switch(link=self.link, dir=self.direction, step=step, old=before.spec,
                           new=self.ladder[chosen].spec, goodput_mbit=None if rate is None else round(rate * 8e-6, 3),
                           rtt_ms=None if measured.rtt_s is None else round(measured.rtt_s * 1e3, 1),
                           compute_s=round(compute, 4), wire_s=round(wires[chosen], 4),
                           wire_s_by_rung={c.spec: round(w, 4) for c, w in zip(self.ladder, wires)})
        return True

    def _wire_bytes(self, codec: Codec) -> float:
        """Last step's bytes had they gone with `codec`: per tensor name, raw bytes x the codec's ratio."""
        total = 0.0
        for name, raw in self.last_raw.items():
            sample = self.samples[name]
            key = (codec.spec, name, tuple(sample.shape))
            if key not in self.ratios:  # a trial encode, stateless, on the sender thread
                payload = codecs.pack(name, "activation", sample.contiguous(), codec)
                self.ratios[key] = payload.wire_bytes / max(sample.numel() * sample.element_size(), 1)
            total += raw * self.ratios[key]
        return total
