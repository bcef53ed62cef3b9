"""Codecs of one link as the runtime uses them: the job's policy, per-tensor state, byte meters."""
from __future__ import annotations

from collections import Counter

import torch

from nebula import codecs
from nebula.wire import TensorPayload

ROLES = {"forward": "activation", "backward": "gradient"}


class LinkCodecs:
    """Packs tensors for one direction-aware link (e.g. a/encoder/0 <-> b/decoder/0)."""

    def __init__(self, policy: "codecs.CompressionPolicy", link: str):
        self.policy, self.link = policy, link
        self.state = codecs.CodecState()
        self._bytes: Counter = Counter()
        self.raw_bytes: Counter = Counter()

    def pack(self, direction: str, name: str, tensor: torch.Tensor, step: int) -> TensorPayload:
        if tensor.is_floating_point():
            codec = self.policy.codec_for(direction, name, tensor.numel(), step)
        else:
            codec = "none"  # token ids, masks: exact, never compressed
        payload = codecs.pack(name, ROLES.get(direction, direction), tensor.contiguous(), codec,
                              state=self.state.slot(f"{self.link}:{direction}", name))
        self._bytes[direction] += payload.wire_bytes
        self.raw_bytes[direction] += tensor.numel() * tensor.element_size()
        return payload

    def unpack(self, payload: TensorPayload) -> torch.Tensor:
        return codecs.unpack(payload)

    def take_bytes(self, direction: str) -> int:
        """Wire bytes sent in `direction` since the last call."""
        return self._bytes.pop(direction, 0)
