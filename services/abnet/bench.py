"""What `nebula bench wan --scenario abnet` needs to know about ABNet-Cloud (nebula_lab.bench.scenarios)."""
from __future__ import annotations

import json
from pathlib import Path

from nebula.shipped import deploy_dir  # the job files, in a checkout or a wheel

HIDDEN = 384  # width of the boundary tensor H_E (multilingual-e5-small)
QUICK_EVAL = 50


class AbnetScenario:
    # the paper's shape (24 tokens, adapters after every layer), which the recorded tables measured;
    # not the demo's job, whose short-run settings (16 tokens, sentences that fit) are tuned for BLEU
    job = deploy_dir() / "jobs" / "abnet-es-en-full.toml"
    quality_key = "bleu"

    def speed_job(self, raw: dict, work: Path, steps: int) -> dict:
        """Fixed-shape training data, truncated to max_len (a job that skips long sentences would have
        none left); only the examples the run uses are loaded; no test decoding; a linear schedule's
        warm-up cut to fit the run (it changes the rate, not the work of a step)."""
        raw["job"]["data"] = str(fixed_shape_corpus(Path(raw["job"]["data"]), work / "data"))
        for stage in raw["stages"].values():
            stage["max_train_examples"] = steps * raw["train"].get("batch_size", 32)
            stage.pop("long_sentences", None)
            if stage.get("lr_schedule") == "linear":
                stage["warmup_steps"] = min(stage.get("warmup_steps", 50), steps - 1)
            if stage["impl"] == "abnet-encoder":
                stage["eval_examples"] = 0
        return raw

    def quality_job(self, raw: dict, quick: bool, splits: tuple[str, ...] = ("test",),
                    sentences: int | None = None) -> dict:
        """Score `splits` (valid, test) on `sentences` each (default: the job's, or 50 with `quick`)."""
        for stage in raw["stages"].values():
            if stage["impl"] == "abnet-encoder":
                stage["eval_splits"] = list(splits)
                if sentences or quick:
                    stage["eval_examples"] = sentences or QUICK_EVAL
        return raw

    def quality(self, run: Path, raw: dict) -> dict:
        """BLEU of the first split scored (`bleu`, `test_sentences`), and `bleu_SPLIT` for each."""
        driver = next(name for name, stage in raw["stages"].items() if stage["impl"] == "abnet-encoder")
        splits = next(s for s in raw["stages"].values() if s["impl"] == "abnet-encoder").get("eval_splits", ["test"])
        scores = {split: json.loads((run / driver / f"scores-{split}.json").read_text()) for split in splits}
        first = scores[splits[0]]
        return {"bleu": round(first["bleu"], 2), "test_sentences": first["n"],
                **{f"bleu_{split}": round(s["bleu"], 2) for split, s in scores.items()}}

    def sentence_stats(self, run: Path, raw: dict, split: str):
        """Per-sentence BLEU statistics of `split` (sentences x 10), as the decoder wrote its .hyp/.ref."""
        # why here: numpy, sacrebleu, kept off `nebula --help`
        import numpy as np
        from sacrebleu.metrics import BLEU
        sink = next(name for name, stage in raw["stages"].items() if stage["impl"] == "abnet-decoder")
        hyps, refs = ((run / sink / f"{split}.{ext}").read_text(encoding="utf-8").split("\n")[:-1]
                      for ext in ("hyp", "ref"))
        return np.array(BLEU(lowercase=True)._extract_corpus_statistics(hyps, [refs]), dtype=np.int64)

    @staticmethod
    def score_stats(sums) -> float:
        """BLEU from column sums of sentence_stats (sacrebleu's own path for its paired bootstrap)."""
        # why here: sacrebleu, kept off `nebula --help`
        from sacrebleu.metrics import BLEU
        return BLEU(lowercase=True)._compute_score_from_stats(list(sums)).score

    def step_bytes(self, raw: dict) -> int:
        """One step of H_E, (B, S, H) float32, S = the encoder's max_len."""
        encoder = next(stage for stage in raw["stages"].values() if stage["impl"] == "abnet-encoder")
        return raw["train"].get("batch_size", 32) * encoder.get("max_len", 32) * HIDDEN * 4


def fixed_shape_corpus(data: Path, out: Path, min_words: int = 30) -> Path:
    """The job's corpus with only long training pairs (>= min_words words on both sides): truncated to
    max_len tokens, every micro-batch of every step is (B/M, max_len, H), so each phase moves the
    same bytes and does the same compute, as the paper's fixed-length batches do. Validation and
    test stay whole (the vocabulary cut is built from every split)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = {ext: (data / f"train.{ext}").read_text().splitlines() for ext in ("src", "tgt", "ids")}
    keep = [i for i, (s, t) in enumerate(zip(lines["src"], lines["tgt"]))
            if len(s.split()) >= min_words and len(t.split()) >= min_words]
    for ext, rows in lines.items():
        (out / f"train.{ext}").write_text("".join(rows[i] + "\n" for i in keep))
    for split in ("valid", "test"):
        for ext in ("src", "tgt", "ids"):
            target = out / f"{split}.{ext}"
            if not target.exists():
                target.symlink_to(data / f"{split}.{ext}")
    return out


SCENARIO = AbnetScenario()
