"""What `nebula demo` shows at the end: held-out examples beside their references, BLEU with its
interval, steps, time, the bytes each way and the codecs' ratio; and the same as `report.md`.

The examples are chosen by a fixed rule, never by their quality: `EXAMPLES` sentences evenly spaced
over the evaluated sample (which is itself spread evenly over the held-out test packages).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nebula.runtime.records import read_records
from services.abnet.stages import spread

EXAMPLES = 6


@dataclass(frozen=True)
class Traffic:
    """Tensor payload bytes over a run: before (raw) and after the codecs (wire)."""
    raw: int
    wire: int
    codecs: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return self.wire / self.raw if self.raw else 1.0


def traffic(link_log: Path, direction: str) -> Traffic:
    """Sum of a stage's link.jsonl records sent in `direction` ("forward"/"backward"), training and
    evaluation passes alike."""
    raw = wire = 0
    codecs: list[str] = []
    for r in read_records(link_log, kind=None):  # link records carry no "kind"
        if r.get("dir") == direction:
            raw, wire = raw + r["raw"], wire + r["wire"]
            if r["codec"] not in codecs:
                codecs.append(r["codec"])
    return Traffic(raw, wire, tuple(codecs))


def examples(run: Path, source: str, sink: str, k: int = EXAMPLES, split: str = "test") -> list[tuple[str, str, str]]:
    """(source, reference, translation) of k evaluated sentences of `split` evenly spaced over the sample: the
    encoder wrote the sources at site a, the decoder the references and translations at site b."""
    src, ref, hyp = (_lines(run / stage / f"{split}.{ext}") for stage, ext in
                     ((source, "src"), (sink, "ref"), (sink, "hyp")))
    n = min(len(src), len(ref), len(hyp))
    return [(src[i], ref[i], hyp[i]) for i in spread(n, k)] if n else []


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def summary_lines(scores: dict, steps: int, train_s: float, wall_s: float,
                  forward: Traffic, backward: Traffic) -> list[str]:
    ci = f" ± {scores['bleu_ci']:.2f} (95% bootstrap)" if "bleu_ci" in scores else ""
    return [
        f"BLEU {scores['bleu']:.2f}{ci} on {scores['n']} held-out {scores.get('split', 'test')} sentences (sacrebleu, "
        "case-insensitive)",
        f"{steps} steps, training {train_s / 60:.1f} min, whole demo {wall_s / 60:.1f} min",
        f"sent a->b {megabytes(forward.wire)} ({'+'.join(forward.codecs)}: {forward.ratio:.3f} of the raw "
        f"{megabytes(forward.raw)}); b->a {megabytes(backward.wire)} ({'+'.join(backward.codecs)}: "
        f"{backward.ratio:.3f} of {megabytes(backward.raw)})",
    ]


def print_examples(rows: list[tuple[str, str, str]]) -> None:
    for src, ref, hyp in rows:
        print(f"  es:        {src}\n  reference: {ref}\n  nebula:    {hyp}\n")


def write_report(out: Path, title: str, lines: list[str], rows: list[tuple[str, str, str]],
                 job: dict, plot: str = "loss.png") -> Path:
    """report.md beside the loss plot: the summary, the examples as a table, the job that ran."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    table = ["| Spanish (held out) | reference | translation |", "|---|---|---|"]
    table += [f"| {cell(s)} | {cell(r)} | {cell(h)} |" for s, r, h in rows]
    body = [f"# {title}", "", *[f"- {line}" for line in lines], "",
            f"![training loss]({plot})", "",
            f"## {len(rows)} held-out sentences, evenly spaced over the evaluated sample (not chosen by quality)",
            "", *table, "", "## The job", "", "```json", json.dumps(job, indent=1, default=str), "```", ""]
    out.write_text("\n".join(body), encoding="utf-8")
    return out
