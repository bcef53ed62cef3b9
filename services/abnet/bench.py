"""What `nebula bench wan --scenario abnet` needs to know about ABNet-Cloud (nebula.bench.scenarios)."""
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
        """Fixed-shape training data; only the examples the run uses are loaded; no test decoding."""
        raw["job"]["data"] = str(fixed_shape_corpus(Path(raw["job"]["data"]), work / "data"))
        for stage in raw["stages"].values():
            stage["max_train_examples"] = steps * raw["train"].get("batch_size", 32)
            if stage["impl"] == "abnet-encoder":
                stage["eval_examples"] = 0
        return raw

    def quality_job(self, raw: dict, quick: bool) -> dict:
        if quick:
            for stage in raw["stages"].values():
                if stage["impl"] == "abnet-encoder":
                    stage["eval_examples"] = QUICK_EVAL
        return raw

    def quality(self, run: Path, raw: dict) -> dict:
        driver = next(name for name, stage in raw["stages"].items() if stage["impl"] == "abnet-encoder")
        scores = json.loads((run / driver / "scores.json").read_text())
        return {"bleu": round(scores["bleu"], 2), "test_sentences": scores["n"]}

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
