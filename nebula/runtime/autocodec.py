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
and it looks again as soon as the meter is warm, not `every` steps later.

Going back to a less lossy rung is a trial when nothing has measured messages of its size: the
estimate then comes from smaller messages, which mislead both ways. A token bucket passes them faster
than the rate (at 0.823 Mbit/s, int8(lowrank(0.25)) messages read 2.73 Mbit/s and vouched for the
twice larger int8(lowrank(0.5)), 1.59 s/step against 1.33); over a long round trip each pays fixed
costs that make a fast link read slow (5 kB messages read 2-6 Mbit/s at 60 Mbit/s and 80 ms), so
going by them a link that got faster was never tried again (bench wan --auto --change). So the next
rung up is tried whatever they say, once its wait is over: it is used, judged as soon as its own
messages are acknowledged, kept (and the next one up tried) or left. The rung above one just moved
down to waits 2 x `every` steps; one whose trial failed is not tried again for `every` x 2, 4, ...
2**TRIES steps, so a slow link costs a step now and then, and a link that got faster is found within
`every` x 2**TRIES steps, then climbed about a rung a step. A failed trial leaves a queue on the
path: the next messages wait behind it without the bucket's burst and read slower than their rung
runs (in a token-bucket simulation, 13 of the next 16), so for `every` x HOLD steps only a clear
bottleneck moves the rung.

The rung in force is judged on its own messages only: where none of about its size were acknowledged
lately (a trial's first step, or a phase of other codecs in between), auto waits a step. Smaller
messages mislead both ways: a token bucket passes them faster than its rate (above), and at 60 Mbit/s
and 80 ms RTT the fixed costs of a 5 kB message made the path read 8 Mbit/s, which sent a lossless
`none` to fp16 for 4 steps (bench wan --auto, run 10) before its trial brought it back.

Every message names its codec, so the receiver follows without being told; each switch is a
`compression` event in the stage's metrics and a line in link.jsonl. One-site links (no measured goodput)
stay on the first rung.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from nebula import codecs
from nebula.codecs.auto import Auto
from nebula.codecs.base import Codec
from nebula.transport.goodput import SAMPLES, Goodput

RELAX = 0.8  # going back to a less lossy rung needs this much more room
TRIES = 4  # a rung whose trial failed waits every x 2**failures steps, at most every x 2**TRIES
HOLD = 4  # after a failed trial, every x HOLD steps on the rung it left, unless that one is clearly too slow


class AutoChoice:
    """The rung in force for one (link, direction); runs on the sender thread. `goodput(message_bytes)`:
    the path's (None: nothing measured, stay on the first rung); `compute()`: the sender's s/step;
    `default_headroom`: the schedule's, where the job sets none (nebula.codecs.auto)."""

    def __init__(self, link: str, direction: str, settings: Auto, goodput: Callable[[int], Goodput | None],
                 compute: Callable[[], float | None], on_switch: Callable[..., None], default_headroom: float):
        self.link, self.direction, self.settings = link, direction, settings
        self.headroom = settings.headroom_or(default_headroom)
        self.ladder = settings.ladder
        self.goodput, self.compute, self.on_switch = goodput, compute, on_switch
        self.rung, self.step, self.warm = 0, 0, False
        self.decided_at: int | None = None  # the step of the last decision
        self.trial: int | None = None  # the rung on trial: chosen on an estimate from smaller messages
        self.failures: Counter = Counter()  # rung -> trials that failed in a row
        self.retry_at: dict[int, int] = {}  # rung -> the step before which it is not tried again
        self.hold_until = 0  # before this step only a clear bottleneck moves: a failed trial's queue drains
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
            due = self.decided_at is None or not self.warm or self.trial is not None \
                or step - self.decided_at >= self.settings.every
            if due and self._decide(step):  # a cold meter or a trial looks every step
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
        wires, rates, sized = self._predict()
        if (not self.warm or step < self.hold_until) and wires[self.rung] <= compute:
            return False  # starting up, or a failed trial's queue still drains: move on a clear bottleneck only
        if not sized[self.rung]:
            return False  # no recent ACKs of the rung in force's own messages (a trial's, or after other codecs)
        budget = self.headroom * compute
        failed = self._judge_trial(wires[self.rung] <= budget, step)
        fits = [i for i, w in enumerate(wires)
                if (i > self.rung or not failed) and self._fits(i, w, budget, sized[i], step)]
        chosen = fits[0] if fits else len(self.ladder) - 1
        if chosen < self.rung and not sized[chosen]:
            self.trial = chosen
        elif chosen > self.rung:  # the rung above the new one did not fit just now: not tried at once
            self.retry_at[chosen - 1] = max(self.retry_at.get(chosen - 1, 0), step + 2 * self.settings.every)
        if chosen != self.rung:
            before, self.rung, rate = self.ladder[self.rung], chosen, rates[chosen]
            self.on_switch(link=self.link, dir=self.direction, step=step, old=before.spec,
                           new=self.ladder[chosen].spec, goodput_mbit=None if rate is None else round(rate * 8e-6, 3),
                           rtt_ms=None if measured.rtt_s is None else round(measured.rtt_s * 1e3, 1),
                           compute_s=round(compute, 4), wire_s=round(wires[chosen], 4), trial=self.trial == chosen,
                           wire_s_by_rung={c.spec: round(w, 4) for c, w in zip(self.ladder, wires)})
        return True

    def _predict(self) -> tuple[list[float], list[float | None], list[bool]]:
        """Per rung: last step's wire seconds had it gone with that rung, the goodput used (messages of its
        size), and whether that goodput came from messages of its size (else from smaller, faster ones)."""
        wires, rates, sized = [], [], []
        for codec in self.ladder:
            step_bytes = self._wire_bytes(codec)
            got = self.goodput(int(step_bytes / self.messages))
            assert got is not None  # `_decide` had a measurement, and a meter never forgets its last ACKs
            wires.append(step_bytes / got.bytes_per_s if got.bytes_per_s else 0.0)
            rates.append(got.bytes_per_s)
            sized.append(got.sized)
        return wires, rates, sized

    def _fits(self, rung: int, wire: float, budget: float, sized: bool, step: int) -> bool:
        """A rung as lossy as the one in force or more fits in the budget; a less lossy one measured on
        messages of its size needs RELAX x budget. One known only from smaller messages is tried when it
        is the next one up and its wait is over, whatever they say: they mislead both ways (a token bucket
        passes them faster than its rate; over a long round trip their fixed costs make a fast link read
        slow, and a link that got faster was never tried again: docs/bench-wan.md, "The link changes").
        A failed trial costs one rung's extra bytes for a step or two, and doubles the wait."""
        if rung >= self.rung:
            return wire <= budget
        if sized:
            return wire <= RELAX * budget
        return rung == self.rung - 1 and step >= self.retry_at.get(rung, 0)

    def _judge_trial(self, fits: bool, step: int) -> bool:
        """The rung on trial (the one in force), now measured on its own messages: kept if they `fit` (its
        failures forgotten), else left for a lossier one. True when a trial failed."""
        if self.trial is None:
            return False
        trial, self.trial = self.trial, None
        if fits:
            self.failures[trial] = 0
            return False
        self.failures[trial] += 1
        self.retry_at[trial] = step + self.settings.every * 2 ** min(self.failures[trial], TRIES)
        self.hold_until = step + HOLD * self.settings.every
        return True

    def _wire_bytes(self, codec: Codec) -> float:
        """Last step's bytes had they gone with `codec`: per tensor name, raw bytes x the codec's ratio."""
        total = 0.0
        for name, raw in self.last_raw.items():
            sample = self.samples[name]
            key = (codec.spec, name, tuple(sample.shape))
            if key not in self.ratios:  # a trial encode on the sender thread, with a throwaway state
                # (`ef` refuses to encode without one; the stream's own state is not touched)
                payload = codecs.pack(name, "activation", sample.contiguous(), codec, state={})
                self.ratios[key] = payload.wire_bytes / max(sample.numel() * sample.element_size(), 1)
            total += raw * self.ratios[key]
        return total
