"""A tiny GPT job on a tiny corpus, for tests: the real stages and model at d = 16, four blocks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tomli_w

TINY = {"vocab_size": 64, "d_model": 16, "n_head": 2, "n_layer": 4, "seq_len": 16, "lr": 1e-2, "warmup_steps": 2}
CHAIN = (("first", "gpt-first", [0, 2]), ("mid", "gpt-middle", [2, 3]), ("last", "gpt-last", [3, 4]))


def tiny_corpus(directory: Path, seed: int = 0) -> Path:
    """train/valid.tokens as `nebula data prepare-text` writes them: a noisy counting pattern a model can
    learn (each token mostly its predecessor + 1), 4096 and 1024 tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", 4096), ("valid", 1024)):
        steps = np.where(rng.random(n) < 0.9, 1, rng.integers(0, TINY["vocab_size"], n))
        (np.cumsum(steps) % TINY["vocab_size"]).astype("<u2").tofile(directory / f"{split}.tokens")
    return directory


def gpt_job(directory: Path, chain=CHAIN, steps: int = 6, compression: dict | None = None, **options) -> Path:
    """A job file for `chain` ((name, impl, layers) per stage, each at its own site) on a tiny corpus in
    `directory`; `options` go to every stage."""
    data = tiny_corpus(directory / "data")
    stages = {name: {"address": f"{chr(ord('a') + i)}/{name}/0", "impl": impl, "layers": layers, "device": "cpu",
                     **TINY, **options}
              for i, (name, impl, layers) in enumerate(chain)}
    stages[chain[0][0]].setdefault("eval_examples", 8)
    links = [{"from": a[0], "to": b[0], "tensors": ["hidden"], "backward": True,
              **({"compression": compression} if compression else {})} for a, b in zip(chain, chain[1:])]
    job = {"job": {"name": "gpt-tiny", "data": str(data)},
           "train": {"steps": steps, "batch_size": 4, "micro_batches": 2, "checkpoint_every": 2, "seed": 1},
           "stages": stages, "links": links}
    path = directory / "job.toml"
    path.write_text(tomli_w.dumps(job))
    return path
