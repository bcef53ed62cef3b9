"""An emulated device for benchmarks (paper Table 4): every micro-batch takes a fixed wall-clock time.

The discriminator's `device_time = T` makes each micro-batch of each rank take T seconds from the start
of its forward pass to the end of its backward pass: the small stand-in model computes for real, then
the rank sleeps the rest. T is set from the measured compute of a paper-proportioned discriminator times
the device's slowness k (services/electra/bench.py), so n emulated subs do not compete for this machine's
cores as n real ones would; what the run then measures is the runtime's coordination overhead (scatter,
the all-reduce barrier, pace, the credit over the WAN), not how compute scales.

The earlier throttle (sleep until k x the stage's own CPU time) left every sub burning its real compute:
n subs needed n / k cores, and on two cores the generator starved (docs/electra.md, "Throughput").
"""
from __future__ import annotations

import time

import torch

from nebula.errors import ConfigError
from nebula.runtime.stage import finished

WARM_UP = 1  # micro-batches not checked against T: the first pays for allocations


class DeviceTime:
    """The clock of one stage's micro-batches; `wrap` goes on a tensor whose backward runs last."""

    def __init__(self, seconds: float, device: torch.device, key: str):
        self.seconds, self.device, self.key = seconds, device, key
        self.started = (0.0, 0.0)  # (wall, process CPU) at the current micro-batch's forward
        self.seen = 0
        self.waited = 0.0  # seconds asleep in the current micro-batch: the emulated share of T

    def start(self) -> None:
        self.started = (time.perf_counter(), time.process_time())

    def wrap(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(x, self) if x.requires_grad else x

    def wait(self) -> None:
        """At the end of a micro-batch's backward: refuse a T below the real compute, else sleep up to T."""
        finished(self.device)  # a GPU's queued kernels are part of the compute
        wall = time.perf_counter() - self.started[0]
        # the compute is the CPU time it used (not the wall time: on a shared machine that counts waiting for
        # a core too); on a GPU, the wall time once its kernels have finished
        compute = wall if self.device.type == "cuda" else min(wall, time.process_time() - self.started[1])
        self.seen += 1
        if self.seen > WARM_UP and compute > self.seconds:
            raise ConfigError(f"{self.key} = {self.seconds:g} s is less than this stage's real compute per "
                              f"micro-batch ({compute:.3f} s): an emulated device cannot be faster than the model "
                              "that runs; raise it, or make the stand-in model smaller")
        self.waited = max(0.0, self.seconds - wall)
        time.sleep(self.waited)


class _Wait(torch.autograd.Function):
    """Identity whose backward, the last op of a micro-batch's backward pass when it wraps the embeddings'
    output, waits out the device time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: DeviceTime) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.clock.wait()
        return grad, None
