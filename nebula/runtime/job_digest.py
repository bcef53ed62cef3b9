"""One job, one definition: what every stage of a job must agree on, as flat keys, and the first key
where two stages' copies differ.

Each site starts its stages from its own copy of the job file; two copies that differ (a step count, a
codec, a stage's width) trained side by side until something broke, steps later (issue 55: a failure at
step 31). Every stage now announces its definition at hello (nebula.runtime.coordinator: members in
HELLO, the coordinator in RESYNC), and a stage that hears another definition stops before step 1 with
a ConfigError naming that stage and the first key that differs.

The definition is the job as it loads (defaults filled in, so a default written out or left out is the
same job), keyed as the job file names it: `train.steps`, `schedule.name`, `stages.decoder.impl`,
`stages.decoder.lr` (an option), `links.encoder->decoder.compression.phases[0].backward.codec`. What each
site may set for itself is left out: `[job].data` (a path here, a grant there), and a stage's `device`,
`threads`, `ranks` (resolved at the stage's own site) and `init_from` (a path there: replicas that start apart
agree at their first hello, nebula.runtime.replicas), `[train] log_every` and `tensorboard` (reporting),
and a stage option whose field says it may differ (`field(metadata=SITE_LOCAL)`: what a site reports, or
where it writes, never the maths).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from nebula.codecs.auto import Auto
from nebula.codecs.base import Codec
from nebula.errors import ConfigError
from nebula.runtime.job import JobConfig
from nebula.security.canonical import canonical_json

LOCAL_TRAIN = frozenset({"log_every", "tensorboard"})  # [train] keys that only change what a site reports
SITE_LOCAL = {"site_local": True}  # the metadata of a stage option each site may set for itself
VALUE_CLIP = 96  # characters of a value a HELLO carries as it is; a longer one is carried as its hash


@dataclass(frozen=True)
class JobDefinition:
    digest: str  # sha256 of every key and its full value
    keys: dict[str, str]  # key -> its value (canonical JSON), or "sha256:..." of a longer one, in file order

    @classmethod
    def of(cls, job: JobConfig) -> JobDefinition:
        values = definition(job)
        digest = hashlib.sha256(canonical_json(values)).hexdigest()
        return cls(digest, {key: _carried(value) for key, value in values.items()})

    def check(self, stage: str, digest: str, keys: dict[str, str]) -> None:
        """ConfigError when `stage` (its name and address) announced another definition than this one."""
        if digest == self.digest:
            return
        key = first_difference(self.keys, keys)
        where = (f"first differing key {key}: {_shown(self.keys.get(key))} here, {_shown(keys.get(key))} there"
                 if key is not None else "the same keys and values, under another digest: another Nebula?")
        raise ConfigError(f"stage {stage} runs another definition of this job ({where}); give every site the "
                          "same job file (docs/runtime.md, \"One job, one definition\") and start its stages again")


def definition(job: JobConfig) -> dict[str, str]:
    """The job's keys (as the job file names them) -> canonical JSON of their values, in file order."""
    out: dict[str, str] = {"job.name": _json(job.name)}
    _flatten("train", {k: v for k, v in dataclasses.asdict(job.train).items() if k not in LOCAL_TRAIN}, out)
    out["schedule.name"] = _json(job.schedule.name)
    _flatten("schedule", job.schedule.options, out)
    for name, stage in job.stages.items():
        out[f"stages.{name}.address"], out[f"stages.{name}.impl"] = _json(stage.address), _json(stage.impl)
        _flatten(f"stages.{name}", stage.options, out)
    _flatten("integrity", job.integrity, out)
    for link in job.links:
        _flatten(f"links.{link.name}", {"tensors": list(link.tensors), "backward": link.backward,
                                        "compression": link.compression}, out)
    return out


def first_difference(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first key (in `mine`'s order, then `theirs`') whose value differs or that one side lacks."""
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        if mine.get(key) != theirs.get(key):
            return key
    return None


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, (Codec, Auto)):
        out[prefix] = _json(str(value))  # its spec, as a job file writes it
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if not f.metadata.get("site_local"):
                _flatten(f"{prefix}.{f.name}", getattr(value, f.name), out)
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(v) or isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            _flatten(f"{prefix}[{i}]", item, out)
    else:
        out[prefix] = _json(value)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _carried(value: str) -> str:
    return value if len(value) <= VALUE_CLIP else "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def _shown(value: str | None) -> str:
    return "(absent)" if value is None else value
