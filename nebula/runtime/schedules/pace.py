"""The pace credit of forward-only links (paper §3.3, Figure 6), at one stage.

As a receiver, the stage tells the sender of each forward-only in-link every step it applied (a PACE
control message). As a sender, it opens step t only once every forward-only out-link's receiver has
acknowledged step t - credit. Two-way links need no PACE: their gradients pace the sender.
"""
from __future__ import annotations

from typing import Sequence

from nebula.runtime.graph import LinkConfig


class Pace:
    def __init__(self, credit: int, in_links: Sequence[LinkConfig], out_links: Sequence[LinkConfig]):
        self.credit = credit
        self.senders = [link.src for link in in_links if not link.backward]  # told of every step applied
        self.receivers = {link.name: link.dst for link in out_links if not link.backward}
        self.acked = dict.fromkeys(self.receivers, 0)  # out-link -> the last step its receiver applied

    def allows(self, step: int) -> bool:
        """Whether a source may open `step`."""
        return all(acked >= step - self.credit for acked in self.acked.values())

    def lagging(self, step: int) -> list[str]:
        """The receivers whose PACE holds `step` back."""
        return [self.receivers[link] for link, acked in self.acked.items() if acked < step - self.credit]

    def acknowledged(self, link: str, step: int) -> bool:
        """A PACE for `step` from the receiver of `link`; False if `link` is no forward-only out-link."""
        if link not in self.acked:
            return False
        self.acked[link] = max(self.acked[link], step)
        return True

    def reset(self, step: int) -> None:
        """After a restore to `step`: every stage resumed there."""
        self.acked = dict.fromkeys(self.acked, step)
