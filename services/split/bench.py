"""`nebula split bench` (and `run`): a split job across local sites, measured per codec (docs/model.md, "Scale").

For each codec the job runs for `steps` steps as real services on this host (a gateway per site, CURVE
on every socket, each stage its own process: nebula.site.local), with the codec on both directions of
every link; boundary tensors that are not floating point (a causal mask) go through `deflate`, which
is exact (`none` sends everything raw: the baseline). Then, per stage: the step time and compute time
(medians over the steps after the first, which warms up), the most memory it held while training and
its process's peak (start-up included, which builds the whole model: services/split/stage.py); per
link and direction: the bytes per token the codec put on the wire. The unsplit model in one stage at
one site, measured the same way in the same run, is the baseline a user would run instead.
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

from nebula.runtime.job_file import override, read_job_table, write_job_file
from nebula.runtime.metrics import read_records
from services.split.chain import boundaries
from services.split.options import SplitOptions

# a model of this size on a few shared cores: a stage computes for a minute between messages and a gateway may
# be starved for tens of seconds; a bench must wait, not call them dead (nothing restarts in a bench)
PATIENT = {"gateway_timeout": 120.0, "peer_timeout": 900.0}
TIMEOUT_S = 3600  # per run: every stage builds and traces the whole model at start, then minutes a step on 2 cores


def run_bench(job_file: Path, work: Path, codecs: list[str], steps: int) -> dict[str, Any]:
    # why here: the site's builder and supervisor, only for a bench
    from nebula.runtime.job import load_job

    job = load_job(job_file)
    table = portable(read_job_table(job_file), job_file)
    short = override(table, train={"steps": steps, "checkpoint_every": steps, "log_every": 1},
                     stages={name: {"eval_examples": 0} for name in job.stages})
    result: dict[str, Any] = {"job": str(job_file), "steps": steps, "batch_size": job.train.batch_size,
                              "micro_batches": job.train.micro_batches, "runs": {}}
    result["runs"]["unsplit"] = _run(work / "unsplit", unsplit(short))
    for codec in codecs:
        result["runs"][codec] = _run(work / f"codec-{codec}", _with_codec(short, job, codec))
    return result


def run_here(job_file: Path, work: Path, steps: int | None = None) -> dict[str, Any]:
    """Every site of the job on this host, trained to its end (`nebula split run`); -> part 0's scores
    (scores-SPLIT.json), and the wall time."""
    table = portable(read_job_table(job_file), job_file)
    if steps is not None:
        table = override(table, train={"steps": steps})
    found = _run(work, table)
    first = next(iter(table["stages"]))
    scores = sorted((work / first).glob("scores-*.json"))
    return {"wall_s": found["wall_s"], **({"scores": json.loads(scores[0].read_text())} if scores else {})}


def portable(table: dict[str, Any], job_file: Path) -> dict[str, Any]:
    """`table` with the model, weights and tokenizer paths of its split stages made absolute, so that the
    job can be written anywhere (as read_job_table does for [job].data)."""
    out = copy.deepcopy(table)
    base = Path(job_file).resolve().parent
    for stage in out.get("stages", {}).values():
        for section, key in (("model", "config"), ("model", "weights"), ("data", "tokenizer")):
            ref = stage.get(section, {}).get(key)
            if isinstance(ref, str) and (base / ref).exists():
                stage[section][key] = str((base / ref).resolve())
    return out


def unsplit(table: dict[str, Any]) -> dict[str, Any]:
    """The job's model whole, in one stage (its first) at one site: no points, no links."""
    out = copy.deepcopy(table)
    name, first = next(iter(out["stages"].items()))
    first["model"] = {**first["model"], "points": []}
    first["part"] = 0
    out["stages"], out["links"] = {name: first}, []
    return out


def _with_codec(table: dict[str, Any], job: Any, codec: str) -> dict[str, Any]:
    out = copy.deepcopy(table)
    for link in out["links"]:
        masks = [b.name for b in boundaries(job.stage(link["from"]).options, job)[1] if not b.dtype.is_floating_point]
        link["compression"] = {"forward": codec, "backward": codec}
        if codec != "none" and masks:
            link["compression"]["overrides"] = {name: {"forward": "deflate"} for name in masks}
    return out


def _run(run: Path, table: dict[str, Any]) -> dict[str, Any]:
    from nebula.site.local import start_sites

    run.mkdir(parents=True, exist_ok=True)
    job_path = run / "job.toml"
    job = write_job_file(job_path, table)
    started = time.monotonic()
    group = start_sites(run, job_path, restart=False, channel=PATIENT)
    try:
        group.run(lambda: all(group.services[n].finished() for n in job.stages), timeout=TIMEOUT_S,
                  what=f"the bench run {run.name}")
    finally:
        group.stop()
    stages = {name: _stage(run / name, job, name) for name in job.stages}
    return {"wall_s": time.monotonic() - started, "stages": stages}


def _stage(workdir: Path, job: Any, name: str) -> dict[str, Any]:
    steps = [r for r in read_records(workdir / "metrics.jsonl") if r.get("kind") == "step"]
    later = steps[1:] or steps
    memory = json.loads((workdir / "memory.json").read_text()) if (workdir / "memory.json").exists() else {}
    options: SplitOptions = job.stage(name).options
    return {"part": options.part, "step_s": statistics.median(r["step_s"] for r in later),
            "compute_s": statistics.median(r["compute_s"] for r in later), **memory,
            "bytes_per_token": later[-1].get("bytes_per_token", {}) if later else {}}


def print_table(result: dict[str, Any]) -> str:
    lines = [f"{result['job']}: {result['steps']} steps of {result['batch_size']} examples "
             f"({result['micro_batches']} micro-batches); medians after the first step", "",
             f"{'run':<10} {'stage':<10} {'step_s':>8} {'compute_s':>9} {'train MB':>9} {'peak MB':>8}  bytes/token"]
    for run, found in result["runs"].items():
        for name, s in found["stages"].items():
            sent = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(s["bytes_per_token"].items())) or "-"
            lines.append(f"{run:<10} {name:<10} {s['step_s']:>8.2f} {s['compute_s']:>9.2f} "
                         f"{s.get('rss_train_mb', 0):>9,.0f} {s.get('rss_peak_mb', 0):>8,.0f}  {sent}")
    return "\n".join(lines)
