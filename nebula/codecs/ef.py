"""`ef(inner)`: error feedback for a lossy gradient codec (Seide et al. 2014; Karimireddy et al. 2019).

Sender side only: what the inner codec dropped at step t (the residual e_t = y_t - D(E(y_t)), with
y_t = x_t + e_{t-1}) is added to the input at step t+1, so nothing is lost for good and the sum of
what was received tracks the sum of what was meant. The wire layout is the inner codec's; decoding
is the inner codec's. Needs a state (a `CodecState` slot); the residual is a float32 copy of x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import Codec, Meta, Parts, register_codec, require_float
from nebula.errors import CodecError


@register_codec("ef")
@dataclass(frozen=True)
class ErrorFeedback(Codec):
    inner: Codec

    @property
    def needs_ids(self) -> bool:
        return self.inner.needs_ids

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        if state is None:
            raise CodecError(f"codec {self.spec!r} keeps a residual between steps: pass a state, "
                             "e.g. pack(..., state=codec_state.slot(link, name))")
        require_float(self.spec, x)
        target = x.detach().cpu().float()  # may be x itself: never written to
        residual = state.get("residual")
        if isinstance(residual, torch.Tensor) and residual.shape == target.shape:
            target = target + residual
        parts, meta = self.inner.encode(target, state.setdefault("inner", {}), ids=ids)
        # out of place: parts may alias target (ef(none)) and must go on the wire unchanged
        state["residual"] = target - self.inner.decode(parts, meta).view(target.shape)
        return parts, meta

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        return self.inner.decode(parts, meta)
