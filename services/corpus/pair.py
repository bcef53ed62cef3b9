"""One parallel example and its stable id."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """`src` is the non-English side (es, zh), `tgt` the English one; `package` is where it came from."""

    package: str
    src: str
    tgt: str

    @property
    def id(self) -> str:
        """`<package>:<hash>`: the same text from the same package gets the same id on every run and site."""
        digest = hashlib.sha1(f"{self.src}\t{self.tgt}".encode()).hexdigest()[:12]
        return f"{self.package}:{digest}"
