"""Helpers for the ELECTRA-Cloud tests: the tiny job (tests/e2e/jobs/electra.toml) on a copy of the
tiny corpora in tests/e2e/data (the stages cache the shared vocabulary beside the corpora, and a test
must not write into the repository), and the ledger each stage must end with."""
from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import tomllib

from nebula.runtime.job_file import write_job_file
from nebula.runtime.order import ExampleOrder, digest, id_hash
from tests.support.sites import replaced

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "e2e" / "data"
JOBS = TESTS / "e2e" / "jobs"
CORPORA = ("es-en", "zh-en")


def electra_job(root: Path, replace: dict[str, str] | None = None, name: str = "electra") -> Path:
    """tests/e2e/jobs/<name>.toml as `root`/job.toml, its data a fresh copy of the tiny corpora in
    `root`/data, with `replace` (old -> new, each must occur) applied."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    if not data.exists():
        for corpus in CORPORA:
            shutil.copytree(DATA / corpus, data / corpus)
    text = (JOBS / f"{name}.toml").read_text().replace('data = "../data"', f'data = "{data}"', 1)
    path = root / "job.toml"
    write_job_file(path, tomllib.loads(replaced(text, replace, f"{name}.toml")))  # checked as it will load
    return path


@cache
def _tokenizer():
    from services.electra import data
    return data.tokenizer()


def _vocabulary(job, stage: str):
    from services.electra import data
    options = job.stage(stage).options
    return data.load_vocab(Path(job.data), options.vocab_corpora, options.vocab_file, _tokenizer())


def vocabulary_size(job, stage: str) -> int:
    return len(_vocabulary(job, stage))


def examples(job, source: str) -> list[str]:
    """The training example ids of generator `source`, as the stage itself builds them."""
    from services.electra import data
    options = job.stage(source).options
    corpus = data.GeneratorCorpus(Path(job.data), options.corpus, options.tasks, options.max_len,
                                  _vocabulary(job, source), _tokenizer(), options.max_train_examples)
    return corpus.splits["train"].ids


def expected_ledger(job, sources: list[str]) -> list[list]:
    """What each step must have trained on at a stage fed by `sources` (each its own example order)."""
    order = {s: (examples(job, s), ExampleOrder(len(examples(job, s)), job.train.batch_size, job.train.seed))
             for s in sources}
    return [[step, digest([id_hash(ids[i]) for ids, o in order.values() for i in o.indices(step)])]
            for step in range(1, job.train.steps + 1)]


def ledger(workdir: Path) -> list[list]:
    return json.loads((workdir / "ledger.json").read_text())["steps"]
