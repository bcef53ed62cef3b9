"""D untrained against D pre-trained on every held-out evaluation (services.electra.heldout), over seeds.

Run by `nebula electra eval` and by `nebula demo electra`. Given a job (the stages' options, the data), a
fixed corruptor (a generator checkpoint and a seed) and, per training seed, D's untrained and pre-trained
checkpoints, it scores every D on the same held-out items and reports per evaluation the values of each
seed, the mean change, its 95% paired bootstrap interval over items and, with several seeds, the 95% t
interval over seeds (services.electra.paired). The alignment test comes with the shared-token baseline (a
copy detector, services.electra.heldout) that D must beat, and with D on the pairs that baseline cannot
rank. The held-out split is test, or valid where a setting (e.g. the step count) is chosen. Retrieval and the
cross-lingual probe (services.electra.evaluate) are reported beside them with their own intervals: at
this scale they are no measure of learning (docs/electra.md, "Evaluation"), and not targets.
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nebula.errors import ConfigError, DataError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import JobConfig
from nebula.runtime.service import build_stage
from services.electra import evaluate, heldout
from services.electra.paired import compare

SEQUENCES = 256  # held-out sequences corrupted once
# translation pairs of the alignment test: at 500 its paired 95% interval was ~±0.055 wide, more than the changes
# it looks for (+0.01 to +0.03); at 4,000 it is ~±0.021 (docs/electra.md). Both test splits hold more (6,218 es-en
# and 5,058 zh-en lines); each pair costs D two forward passes, ~15 s more of the evaluation in all
PAIRS = 4000
OWN_FIRST = "own translation ranked first"  # the alignment test's metric


@dataclass(frozen=True)
class Setting:
    """What to evaluate: the job, its generator (the corruptor) and discriminator stages, and how much."""

    job: JobConfig
    corruptor: Path | None  # a generator checkpoint; None: the generator as the job builds it (its init)
    seed: int = 0  # of the corruption, the samples of the held-out split, the bootstrap
    sequences: int = SEQUENCES
    pairs: int = PAIRS
    encoder_evals: bool = True  # retrieval and the probe: reported, slower; on the test split only
    split: str = "test"  # or "valid": where a setting is chosen, so that test stays unseen

    def stage(self, impl: str) -> str:
        names = [n for n, s in self.job.stages.items() if s.impl == impl]
        if not names:
            raise ConfigError(f"{self.job.source}: no stage with impl = \"{impl}\" to evaluate")
        return names[0]


def load(job: JobConfig, name: str, checkpoint: Path | None, workdir: Path):
    """Stage `name` as the job builds it, with the weights of `checkpoint` (a step-N.pt) if given."""
    stage = build_stage(job, name, workdir / name, quiet=True)
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file() or not path.name.startswith("step-"):
            raise ConfigError(f"checkpoint {path}: expected an existing step-NNNNNNNN.pt of stage {name}")
        stage.load_state_dict(CheckpointDir(path.parent).load(int(path.stem.split("-")[1]))["stage"])
    return stage


def evaluate_runs(s: Setting, runs: list[tuple[Path | None, Path]]) -> dict[str, Any]:
    """runs: per training seed, (D untrained: its step-0 checkpoint, or None for D as built; D pre-trained)."""
    if not runs:
        raise ConfigError("give at least one pair of discriminator checkpoints (untrained, pre-trained)")
    if s.split not in ("test", "valid"):
        raise ConfigError(f"split {s.split!r}: evaluate on a held-out split, \"test\" or \"valid\"")
    data_root = Path(s.job.data or "")
    pairs = [p for p in evaluate.PAIRS if (data_root / p / f"{s.split}.src").is_file()]
    with tempfile.TemporaryDirectory(prefix="nebula-electra-eval-") as tmp:
        gen = load(s.job, s.stage("electra-generator"), s.corruptor, Path(tmp))
        corruption = heldout.fixed_corruption(gen, s.sequences, s.seed, s.split)
        unigram, mlm = heldout.mlm_metrics(corruption)
        disc = s.stage("electra-discriminator")
        first = load(s.job, disc, None, Path(tmp))
        aligned = {pair: heldout.alignment_set(first, data_root, pair, s.pairs, s.seed, s.split) for pair in pairs}
        scored = [[score(load(s.job, disc, checkpoint, Path(tmp)), corruption, aligned, s) for checkpoint in run]
                  for run in runs]
    n = len(corruption.ids)
    majority = statistics.fmean(float(after.rtd.majority()(torch.ones(1, n, dtype=torch.float64))[0])
                                for _, after in scored)
    rows = [row("MLM", "corruptor G, masked-token accuracy", "unigram", compare([unigram], [mlm], n, s.seed)),
            row("RTD", "ROC-AUC, real vs replaced", "0.5", compare(*_pairs(scored, "auc"), n, s.seed)),
            row("RTD", "accuracy at p = 0.5", f"{majority:.3f} all real",
                compare(*_pairs(scored, "accuracy"), n, s.seed)),
            row("CLM", "D accuracy at masked positions", "-", compare(*_pairs(scored, "clm"), n, s.seed))]
    trained = {getattr(s.job.stage(name).options, "corpus", None) for name in s.job.graph.sources}
    for pair, items in aligned.items():
        rows += alignment_rows(pair, items, scored, s.seed, pair in trained)
    return {"rows": rows, "encoder": [[d.encoder for d in run] for run in scored], "sequences": n,
            "corruptor": str(s.corruptor), "seed": s.seed, "seeds": len(runs), "split": s.split}


def alignment_rows(pair: str, items: heldout.AlignmentSet, scored: list[list[Scored]], seed: int,
                   trained: bool) -> list[dict]:
    """D untrained -> trained; the shared-token baseline -> D trained (D must beat it); and untrained ->
    trained on the pairs where the baseline has no cue."""
    n, key = len(items.true), f"alignment {pair}"
    copy = heldout.shared_token_hits(items)
    tied = int((items.shared_true == items.shared_shuffled).sum())
    return [row(key, OWN_FIRST, "0.5", compare(*_pairs(scored, key), n, seed), trained=trained),
            row(key, f"{OWN_FIRST}: D against the shared-token baseline", "copy",
                compare([copy] * len(scored), _pairs(scored, key)[1], n, seed), trained=trained),
            row(key, f"{OWN_FIRST}, {tied} pairs with no shared-token cue", "0.5",
                compare(*_pairs(scored, f"{key} no cue"), n, seed), trained=trained)]


@dataclass
class Scored:
    """One D's metrics on the fixed items (callables of bootstrap weights) and its encoder evaluations."""

    rtd: heldout.DiscriminatorScores
    metrics: dict[str, Any]
    encoder: list[dict]


def score(disc, corruption: heldout.FixedCorruption, aligned: dict[str, heldout.AlignmentSet], s: Setting) -> Scored:
    scores = heldout.score_discriminator(disc, corruption)
    metrics = {"auc": scores.auc(), "accuracy": scores.accuracy(),
               "clm": heldout.Ratio(scores.clm_hits, corruption.masked),
               **{f"alignment {pair}": heldout.alignment_hits(disc, items) for pair, items in aligned.items()},
               **{f"alignment {pair} no cue": heldout.alignment_hits(disc, items, no_shared_cue=True)
                  for pair, items in aligned.items()}}
    encoder = []
    if s.encoder_evals and s.split == "test":  # evaluate.py's tasks read the test split
        for pair in aligned:
            for task in (evaluate.retrieval, evaluate.probe):
                try:
                    encoder.append(task(disc.pooled, Path(s.job.data or ""), pair, seed=s.seed))
                except DataError as exc:  # e.g. a test split of one package: no probe
                    encoder.append({"task": task.__name__, "pair": pair, "skipped": str(exc)})
    return Scored(scores, metrics, encoder)


def _pairs(scored: list[list[Scored]], key: str) -> tuple[list, list]:
    return [before.metrics[key] for before, _ in scored], [after.metrics[key] for _, after in scored]


def row(task: str, metric: str, baseline: str, result: dict, trained: bool = True) -> dict:
    return {"task": task, "metric": metric, "baseline": baseline, "trained_on": trained, **result}


def format_rows(result: dict[str, Any]) -> str:
    """The comparison as a plain table: before = D untrained (MLM: the unigram baseline; against the
    shared-token baseline: that scorer), after = D pre-trained (MLM: the corruptor G); values are means over
    the seeds; the intervals are over items (paired bootstrap) and, with several seeds, over seeds (t)."""
    seeds = result["seeds"]
    lines = [("evaluation", "metric", "chance", "before", "after", "change [95% items]", "[95% t over seeds]",
              "seeds' changes", "verdict: items / seeds")]
    for r in result["rows"]:
        several = r.get("seed_interval") is not None
        spread = f"{r['seed_spread'][0]:+.3f}..{r['seed_spread'][1]:+.3f}" if several else ""
        over = f"[{r['seed_interval'][0]:+.3f}, {r['seed_interval'][1]:+.3f}]" if several else ""
        note = "" if r["trained_on"] else " (never trained on)"
        lines.append((r["task"], r["metric"], r["baseline"], f"{statistics.fmean(r['before']):.3f}",
                      f"{statistics.fmean(r['after']):.3f}",
                      f"{r['change']:+.3f} [{r['interval'][0]:+.3f}, {r['interval'][1]:+.3f}]", over, spread,
                      r["verdict"] + (f" / {r['seed_verdict']}" if several else "") + note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
    head = (f"held-out {result.get('split', 'test')} packages: {result['sequences']} sequences corrupted once by "
            f"{result['corruptor']} "
            f"(seed {result['seed']}); {seeds} training seed{'s' if seeds > 1 else ''}")
    return f"{head}\n{table}"


def format_encoder(result: dict[str, Any]) -> str:
    """Retrieval and the probe, before and after, per seed (evaluate.format_table; not targets)."""
    out = []
    for k, (before, after) in enumerate(result["encoder"]):
        ran = [r for r in before + after if "skipped" not in r]
        if ran:
            keep = lambda rows: [r for r in rows if "skipped" not in r]  # noqa: E731
            out.append(f"seed {k + 1}:\n{evaluate.format_table(keep(before), keep(after))}")
    return "\n".join(out)
