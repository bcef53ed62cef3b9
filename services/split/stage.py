"""The split stage: one part of any model, cut by torch's splitter, with no stage code to write.

Every stage of a split job is this class: it checks the whole job's split (services.split.chain), builds
the whole model the same way every site does (seeded; local weights), cuts it (services.split.cut) and
keeps its part. Its ports are the tensors crossing its cuts, found by the split, so the runtime checks
every link against them as for any stage. Part 0 reads its examples; a part whose slice of the graph
uses a model input reads it from its own data by example id; the last part computes the loss.

    part 0      model inputs -> its slice -> the boundary tensors of cut 1    (a source)
    part k      boundary tensors of cut k (+ model inputs it uses) -> ... of cut k + 1
    part n      boundary tensors of cut n (+ inputs) -> output -> loss against its targets  (the sink)

Each part is traced for the job's micro-batch (`[train] batch_size / micro_batches` examples); an
inference batch of another size runs in pieces of that size, the last padded.
"""
from __future__ import annotations

import json
import resource
from typing import Any

import torch

from nebula.errors import ConfigError, StageError
from nebula.runtime.stage import Batch, Output, Port, Stage
from services.split.chain import base_dir, boundaries, check_chain, micro_batch
from services.split.cut import split, trace_eval
from services.split.data import example_inputs, open_examples
from services.split.losses import checked, loss_function, per_example, summary
from services.split.model import build_model
from services.split.optim import make_optimizer
from services.split.options import SplitOptions


class SplitStage(Stage):
    """One part of any model the job names, cut at its split points by torch's splitter: no stage code."""

    Options = SplitOptions
    stats = ("tokens",)  # positions a step processed: each link's bytes per token

    @classmethod
    def ports(cls, job: Any, name: str) -> tuple[tuple[Port, ...], tuple[Port, ...]]:
        """The tensors crossing its cuts, found by splitting the model (on the "meta" device): the job's split
        is checked whole here, when the job file loads, before any stage starts."""
        check_chain(job)
        received, sent = boundaries(job.stage(name).options, job)
        return tuple(b.port for b in received), tuple(b.port for b in sent)

    def __init__(self, context, options: SplitOptions):
        super().__init__(context, options)
        job = context.job
        self.chain = check_chain(job)  # before any weight is built
        self.last = options.part == len(self.chain) - 1
        self.micro = micro_batch(job)
        base = base_dir(job)
        model = build_model(options.model, base).to(self.device)
        parts = split(model, example_inputs(options.data, self.micro, self.device), options.model.points,
                      options.model.splitter)
        self.part = parts[options.part]
        del model, parts  # the other parts' weights go: this stage holds its slice only
        if (self.part.receives, self.part.sends) != boundaries(options, job):
            raise StageError(f"stage {context.name}: the split of the built model differs from the one the job "
                             "file's ports were checked against: does the model depend on its weights' values?")
        self.module = self.part.module
        needs_data = options.part == 0 or self.last or bool(self.part.inputs)
        self.data = open_examples(options.data, context.data, base, context.workdir) if needs_data else None
        self.loss = loss_function(options.loss) if self.last else None
        self.optimizer, self.scheduler = make_optimizer(options.optimizer, self.module.parameters(), job.train.steps)
        self._rss_train = 0  # KiB: the most this process held after a forward or before a step

    # -- the maths ---------------------------------------------------------------------------------
    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        n = int(batch.ids.shape[0])
        local = self._local(batch.split, self._rows(batch)) if self.part.inputs else {}
        if batch.training and n != self.micro:
            raise StageError(f"stage {self.context.name}: a training micro-batch of {n} examples; the model was "
                             f"split for {self.micro} ([train] batch_size / micro_batches)")
        out = self.part.run(inputs, local) if batch.training else self._pieces(inputs, local, n)
        stats = {"tokens": float(n * self._positions())}
        self._note_memory()
        if not self.last:
            return Output(tensors=out, stats=stats)
        targets = self.data.targets(batch.split, self._rows(batch)).to(self.device)
        return Output(loss=checked(self.loss, self.options.loss, out, targets), stats=stats)

    def examples(self, split: str) -> list[str]:
        if self.data is None or split not in self.data.ids:
            raise ConfigError(f"stage {self.context.name}: no split {split!r} in its data")
        return self.data.ids[split]

    def optimizer_step(self, step: int) -> None:
        self._note_memory()
        super().optimizer_step(step)

    def _rows(self, batch: Batch) -> list[int]:
        return batch.indices if batch.indices is not None else self.data.lookup(batch.split, batch.ids)

    def _positions(self) -> int:
        """Positions per example: a token window's, or the padded text's."""
        data = self.options.data
        return data.seq_len if data.format == "tokens" else data.max_len if data.format != "factory" else 1

    def _pieces(self, received: dict[str, torch.Tensor], local: dict[str, torch.Tensor], n: int) -> Any:
        """An inference batch of `n` examples run in pieces of the traced micro-batch, the last padded
        with copies of its last example, which are dropped again."""
        if self.part.mode_dependent and self.part.eval_module is None:
            self._trace_eval()
        outs = []
        for start in range(0, n, self.micro):
            take = min(self.micro, n - start)
            out = self.part.run({k: _padded(v[start:start + take], self.micro) for k, v in received.items()},
                                {k: _padded(v[start:start + take], self.micro) for k, v in local.items()},
                                training=False)
            outs.append(out[:take] if isinstance(out, torch.Tensor) else {k: v[:take] for k, v in out.items()})
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def _trace_eval(self) -> None:
        """The part's twin in eval mode (its dropout off), cut from the model built again; once, at the first
        inference. Training never needs it, so a stage that only trains traces the model once."""
        o = self.options
        model = build_model(o.model, base_dir(self.context.job)).to(self.device)
        trace_eval(self.part, model, example_inputs(o.data, self.micro, self.device), o.model.points)

    # -- evaluation --------------------------------------------------------------------------------
    def infer(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> list[list[float]]:
        """[summed loss, count, correct] per example (services.split.losses.per_example)."""
        return self._per_example(batch.split, self._rows(batch), inputs)

    def _local(self, split: str, rows: list[int]) -> dict[str, torch.Tensor]:
        """The model inputs this part reads from its own data, for `rows` of `split`."""
        return {k: v.to(self.device) for k, v in self.data.inputs(split, rows).items() if k in self.part.inputs}

    def _per_example(self, split: str, rows: list[int], received: dict[str, torch.Tensor]) -> list[list[float]]:
        out = self._pieces(received, self._local(split, rows), len(rows))
        return per_example(self.options.loss, self.loss, out, self.data.targets(split, rows).to(self.device))

    def score(self, split: str, results: list[Any]) -> dict[str, Any]:
        return summary(self.options.loss, split, results)

    def score_here(self, split: str, rows: list[int]) -> dict[str, Any]:
        """`rows` of `split` scored in this process, as an evaluation across the sites scores them: the whole
        model's stage only (the peers of the replicas bench: services.split.peer)."""
        if not self.last or self.options.part != 0:
            raise StageError(f"stage {self.context.name}: scoring in one process needs the whole model (no points)")
        size = self.options.eval_batch_size
        with torch.no_grad():
            results = [row for start in range(0, len(rows), size)
                       for row in self._per_example(split, rows[start:start + size], {})]
        return self.score(split, results)

    def eval_rows(self) -> list[int]:
        """The rows of `eval_split` an evaluation after training scores: `eval_examples`, spread over it."""
        total = len(self.examples(self.options.eval_split))
        n = min(self.options.eval_examples, total)
        return [i * total // n for i in range(n)]

    def after_training(self, runner) -> None:
        """Part 0 scores `eval_examples` of `eval_split`, spread over it, across the sites:
        scores-SPLIT.json here and a line of SPLIT.jsonl (one per evaluation)."""
        o = self.options
        if not o.eval_examples:
            return
        scores = runner.evaluate(o.eval_split, self.eval_rows(), o.eval_batch_size)
        score = {**next(iter(scores.values())), "step": runner.step}
        (self.context.workdir / f"scores-{o.eval_split}.json").write_text(json.dumps(score, indent=1))
        with open(self.context.workdir / f"{o.eval_split}.jsonl", "a") as log:
            log.write(json.dumps(score) + "\n")

    # -- memory ------------------------------------------------------------------------------------
    def _note_memory(self) -> None:
        """memory.json: this process's peak RSS (its start-up, which builds the whole model, included) and
        the most it held while training (sampled after each forward and before each step), for the bench."""
        if self.context.rank != 0:
            return
        rss = _rss_kib()
        if rss <= self._rss_train:
            return
        self._rss_train = rss
        record = {"rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_train_mb": rss / 1024}
        if self.device.type == "cuda":
            record["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        (self.context.workdir / "memory.json").write_text(json.dumps(record))


def _padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    if tensor.shape[0] == size:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(size - tensor.shape[0], *tensor.shape[1:])])


def _rss_kib() -> int:
    """The process's resident memory now (Linux), in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
