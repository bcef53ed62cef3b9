"""Sender-side codec state, one private dict per stream, keyed by (link, tensor name).

Only the sender keeps state (error-feedback residuals, the low-rank basis of the previous step):
every message decodes on its own. A slot remembers which codec filled it; when the codec of a
stream changes (e.g. at the policy's start_step) the slot is emptied rather than misapplied.
"""
from __future__ import annotations

from typing import Any


class CodecState:
    def __init__(self) -> None:
        self._slots: dict[tuple[str, str], dict[str, Any]] = {}

    def slot(self, link: str, name: str) -> dict[str, Any]:
        """The mutable state of one stream; pass it to `pack(..., state=...)` every step."""
        return self._slots.setdefault((link, name), {})

    def reset(self, link: str | None = None) -> None:
        """Forget every stream (or only one link's), e.g. after a peer restarted."""
        for key in [key for key in self._slots if link is None or key[0] == link]:
            del self._slots[key]

    def __len__(self) -> int:
        return len(self._slots)

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints (torch.save): {"slots": [[link, name, slot], ...]}."""
        return {"slots": [[link, name, slot] for (link, name), slot in self._slots.items()]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._slots = {(link, name): slot for link, name, slot in saved["slots"]}


def claim(slot: dict[str, Any] | None, spec: str) -> dict[str, Any] | None:
    """The slot, emptied first if another codec filled it."""
    if slot is not None and slot.get("spec") != spec:
        slot.clear()
        slot["spec"] = spec
    return slot
