"""ABNet-Cloud stage services: the encoder at the source site, the decoder at the target site."""
from __future__ import annotations

import json

import torch

from nebula.errors import ConfigError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.link import LinkCodecs
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.registry import register_stage
from nebula.runtime.schedule import Schedule
from nebula.runtime.head import HeadRunner
from nebula.runtime.split import INPUT_SPLIT
from nebula.runtime.tail import TailRunner
from nebula.runtime.stage import Stage
from nebula.transport.base import Channel
from services.abnet.baseline import BaselineConfig
from services.abnet.model import AbnetConfig


def _abnet_config(options: dict) -> AbnetConfig:
    known = AbnetConfig.__dataclass_fields__
    return AbnetConfig(**{k: v for k, v in options.items() if k in known and k != "cache_dir"})


def _baseline(options: dict) -> BaselineConfig | None:
    """`model = "transformer"`: a from-scratch Transformer of similar trainable size (paper Table 2)."""
    model = options.get("model", "abnet")
    if model not in ("abnet", "transformer"):
        raise ConfigError(f"model = {model!r}: use \"abnet\" (frozen PLM + adapters) or \"transformer\" "
                          "(from scratch, the comparison baseline)")
    return BaselineConfig(objective=options.get("objective", "cmlm")) if model == "transformer" else None


def spread(total: int, n: int) -> list[int]:
    """`n` indices evenly spaced over `total` examples: the test file is grouped by source package,
    so its first n sentences would all come from one or two packages."""
    n = min(n, total)
    return [i * total // n for i in range(n)]


class _AbnetStage(Stage):
    peer_name: str

    def runner_args(self, channel: Channel, model) -> dict:
        peer = self.job.stage(self.peer_name).address
        link = "|".join(sorted([self.config.address, peer]))
        return dict(job=self.job.name, channel=channel, peer=peer, model=model,
                    codecs=LinkCodecs.from_table(self.job.compression, link, self.workdir / "link.jsonl"),
                    train=self.job.train, checkpoints=CheckpointDir(self.workdir / "checkpoints"),
                    metrics=MetricsLog(self.workdir / "metrics.jsonl", self.name, self.job.train.log_every,
                                       quiet=self.quiet))


@register_stage("abnet-encoder")
class AbnetEncoder(_AbnetStage):
    """Site a: frozen multilingual-e5-small + adapters; sends H_E, receives dL/dH_E."""

    peer_name = "decoder"

    def build(self):
        from services.abnet.sides import EncoderSide
        from services.abnet.xlmr_e5 import load_e5_small
        torch.manual_seed(self.job.train.seed)
        return EncoderSide(load_e5_small(), self.job.data, self.job.train, _abnet_config(self.config.options),
                           limit=self.config.options.get("max_train_examples"),
                           baseline=_baseline(self.config.options))

    def translate(self, channel: Channel, lines: list[str]) -> list[str]:
        """Cross-site inference from the last common checkpoint: encode here, decode at site b."""
        model = self.build()
        model.add_input(INPUT_SPLIT, lines)
        runner = HeadRunner(**self.runner_args(channel, model))
        try:
            runner.start()
            result = runner.evaluate(INPUT_SPLIT, list(range(len(lines))),
                                     int(self.config.options.get("eval_batch_size", 32)))
            runner.finish()
            return result["translations"]
        finally:
            runner.close()

    def run(self, channel: Channel) -> None:
        opts = self.config.options
        model = self.build()
        runner = HeadRunner(**self.runner_args(channel, model))
        try:
            runner.run(Schedule(model.n_train, self.job.train.batch_size, self.job.train.seed))
            test = spread(len(model.data.splits["test"]["rows"]), int(opts.get("eval_examples", 500)))
            scores = runner.evaluate("test", test, int(opts.get("eval_batch_size", 32)))
            (self.workdir / "scores.json").write_text(json.dumps(scores, indent=1, ensure_ascii=False))
            runner.finish()
            runner.write_ledger(self.workdir / "ledger.json")
        finally:
            runner.close()


@register_stage("abnet-decoder")
class AbnetDecoder(_AbnetStage):
    """Site b: frozen all-MiniLM-L6-v2 + cross-attention adapters, length predictor, output head."""

    peer_name = "encoder"

    def run(self, channel: Channel) -> None:
        from services.abnet.minilm import load_minilm
        from services.abnet.sides import DecoderSide
        torch.manual_seed(self.job.train.seed + 1)
        opts = self.config.options
        model = DecoderSide(load_minilm(), self.job.data, self.job.train, _abnet_config(opts),
                            enc_hidden=int(opts.get("enc_hidden", 384)), limit=opts.get("max_train_examples"),
                            decode_iterations=int(opts.get("decode_iterations", 10)),
                            beam=int(opts.get("beam", 4)), baseline=_baseline(opts))
        runner = TailRunner(**self.runner_args(channel, model), outputs=self.workdir)
        try:
            runner.run()
            runner.write_ledger(self.workdir / "ledger.json")
        finally:
            runner.close()
