"""Reading the JSON-lines files a run writes: metrics.jsonl (nebula.runtime.metrics), link.jsonl, the
audit log. Apart from the writer so that the readers (benchmarks, plots, demos: some of them on every
`nebula --help`) import nothing but the standard library.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_records(path: str | Path, kind: str | None = "step") -> list[dict[str, Any]]:
    """Records of a JSON-lines file (metrics, meters, audit) of one `kind` (None: all); a line being
    written right now is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if kind is None or r.get("kind") == kind]
