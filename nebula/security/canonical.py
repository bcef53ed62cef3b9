"""Canonical JSON: the one byte encoding that signatures and audit hashes are computed over.

Sorted keys, no whitespace and ASCII-only output make the encoding independent of dict order and
of how a file was pretty-printed, so a certificate re-serialised by another tool still verifies.
"""
from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Encode `obj` deterministically; floats that are NaN or infinite are refused (not JSON)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
