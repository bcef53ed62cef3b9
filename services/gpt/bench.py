"""What `nebula bench wan --scenario gpt --time-to-loss TARGET` needs to know about the GPT workload
(nebula_lab.bench.scenarios.TimeToLoss): the 4-site job at a size that reaches a target in minutes on
two CPU cores, and the settings to compare (docs/gpt.md has the table)."""
from __future__ import annotations

import json
from pathlib import Path

from nebula.shipped import deploy_dir  # the job files, in a checkout or a wheel

# The bench's model: the 4-site job's 8 blocks, narrower and on shorter windows than the job file's
# d = 256 / 256 tokens, so that one setting and seed reaches the target in a few minutes here.
BENCH_MODEL = {"d_model": 128, "n_head": 4, "seq_len": 128, "lr": 2e-3, "warmup_steps": 30}
EVAL_WINDOWS = 64  # the fixed held-out set: 64 windows spread over the validation packages

DENSE = {"schedule": None, "stages": {}}
CODE = {"bottleneck": 24, "reembed": True}  # 24 int4 values a token: 12 bytes + scales, 1/20 of bf16
# The schedule and micro-batch count each setting is timed with: same weights, so the steps to a target do
# not change with them. Dense: the fastest of `nebula bench wan --scenario gpt --peer torch` (m 8 and 16 x
# synchronous, gpipe, 1f1b at the 5x rate: synchronous m = 16, 1f1b 1% behind; docs/gpt.md). The code's
# were not swept (it is compute-bound there: m = 16 keeps its fill at 3/16 of a step).
DENSE_SPEED = {"schedule": "synchronous", "micro_batches": 16}
CODE_SPEED = {"schedule": "1f1b", "micro_batches": 16}
SETTINGS = [  # the first is the dense reference (and calibrates the communication-bound rate)
    {"name": "dense bf16", "forward": "bf16", "backward": "bf16", **DENSE, "speed": DENSE_SPEED},
    # the code model's architecture but the boundary: its re-embedding tables on a dense link
    {"name": "dense bf16 + re-embedding tables", "forward": "bf16", "backward": "bf16", "schedule": None,
     "stages": {"reembed_stream": True}, "speed": DENSE_SPEED},
    {"name": "bottleneck 24 + reembed, int4/int8", "forward": "int4", "backward": "int8", "schedule": None,
     "stages": CODE, "speed": CODE_SPEED},
    {"name": "dense fp32", "forward": "none", "backward": "none", **DENSE},
    {"name": "dense int8(lowrank(0.1))", "forward": "int8(lowrank(0.1))", "backward": "int8(lowrank(0.1))", **DENSE},
    # its rung depends on the link: timed alone, its steps those of the setting trained with that rung
    {"name": "auto", "forward": "auto", "backward": "auto", **DENSE},
    {"name": "bottleneck 24, no reembed, int4/int8", "forward": "int4", "backward": "int8", "schedule": None,
     "stages": {**CODE, "reembed": False}},
    {"name": "bottleneck 24 + reembed, fp32", "forward": "none", "backward": "none", "schedule": None,
     "stages": CODE},
    {"name": "bottleneck 24 + reembed, int4/int8, stale", "forward": "int4", "backward": "int8",
     "schedule": "one-step-stale", "stages": CODE},
    {"name": "dense bf16, stale", "forward": "bf16", "backward": "bf16", "schedule": "one-step-stale", "stages": {}},
]
QUICK = 3  # the reference, its tables baseline and the code: compared over every seed; the ablations over one
for _ablation in SETTINGS[QUICK:]:
    _ablation["seeds"] = 1


class GptScenario:
    job = deploy_dir() / "jobs" / "gpt-4site.toml"

    def ttl_job(self, raw: dict, quick: bool) -> dict:
        """The bench's model on every stage, batches of 16 windows, the validation loss scored after each part."""
        raw["train"].update(batch_size=16, micro_batches=4)
        for stage in raw["stages"].values():
            stage.update(BENCH_MODEL)
            stage["eval_examples"] = EVAL_WINDOWS if stage["impl"] in ("gpt-first", "gpt-whole") else 0
        return raw

    def ttl_settings(self, quick: bool) -> list[dict]:
        return [dict(s) for s in SETTINGS[:QUICK if quick else None]]

    def speed_job(self, raw: dict, work: Path, steps: int) -> dict:
        """Windows are all seq_len tokens, so every phase moves the same bytes; no evaluation."""
        for stage in raw["stages"].values():
            stage["eval_examples"] = 0
        return raw

    def eval_curve(self, run: Path, raw: dict) -> list[list[float]]:
        """The first stage's valid.jsonl: one [step, loss] per evaluation (the last of a step counts)."""
        first = next(name for name, stage in raw["stages"].items() if stage["impl"] in ("gpt-first", "gpt-whole"))
        path = run / first / "valid.jsonl"
        points = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            points[record["step"]] = record["loss"]
        return [[step, loss] for step, loss in sorted(points.items())]

    # -- the torch.distributed.pipelining peer (nebula_lab.bench.torch_peer) ---------------------------------
    def peer_module(self, stage, first: bool, last: bool, dtype):
        """The stage's own module as torch's pipeline calls it: tokens in at the first stage, the previous
        stage's activation elsewhere; the activation out in `dtype` (what crosses the link), logits at the last."""
        import torch

        class Boundary(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.part = stage.module

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out = self.part(x) if first else self.part(None, x.float())
                return out if last else out.to(dtype)
        return Boundary()

    def peer_batch(self, stage, indices: list[int]):
        """(inputs, targets) of the training windows at `indices`, (B, T) each."""
        return stage.data.windows("train", indices)

    def peer_loss(self, logits, targets):
        from services.gpt.model import lm_loss
        return lm_loss(logits, targets)

    def peer_eval(self, stage, module) -> float:
        """The validation loss of `module` (the whole model) on the windows the runtime's evaluation scores."""
        import torch

        from services.gpt.model import lm_loss
        from services.gpt.stages import eval_windows
        chosen, size = eval_windows(stage.data, stage.options), stage.options.eval_batch_size
        total, tokens = 0.0, 0
        module.train(False)  # as the runtime scores: without dropout (back in training mode after)
        with torch.no_grad():
            for start in range(0, len(chosen), size):
                inputs, targets = stage.data.windows("valid", chosen[start:start + size])
                total += float(lm_loss(module(inputs), targets, reduction="sum_rows").sum())
                tokens += targets.numel()
        module.train(True)
        return total / max(1, tokens)

    def step_bytes(self, raw: dict) -> int:
        """One step of the residual stream on a link, (B, T, d) float32."""
        stage = next(iter(raw["stages"].values()))
        return raw["train"].get("batch_size", 8) * stage.get("seq_len", 256) * stage.get("d_model", 256) * 4


SCENARIO = GptScenario()
