"""`nebula data prepare-pairs`: translation-pair detection from the parallel corpus (`nebula data prepare`),
a classification task for fine-tuning an encoder split across sites (deploy/jobs/minilm-pairs-2site.toml).

Each English sentence of a split appears twice: with its own Spanish translation (label 1) and with the
translation of another sentence of the same split (label 0), the one next to it in order of Spanish
length. Each Spanish sentence too appears once in each class, so neither side alone says the label:
chance is 50%; and the wrong partner is about as long as the right one, so that length, the shortcut,
says little (the manifest gives what a rule on |log(len es / len en)|, fitted on train, scores). Splits
keep the corpus's (held-out packages for valid and test).

    data/pairs-es-en/{train,valid,test}.jsonl    {"id", "en", "es", "label"} per line, shuffled
    data/pairs-es-en/manifest.json               counts, chance, the length rule's accuracy
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from services.corpus import ParallelSide

SPLITS = ("train", "valid", "test")


def register(data_sub) -> None:
    p = data_sub.add_parser("prepare-pairs", help="translation-pair detection (is B the translation of A?) "
                            "from `nebula data prepare`'s corpus: a classification task (docs/model.md)")
    p.add_argument("--corpus", type=Path, default=Path("data/es-en"), help="a language pair's directory "
                   "(default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("data/pairs-es-en"), help="output directory (default: %(default)s)")
    p.add_argument("--max-train", type=int, default=20000, help="source sentences of train used, chosen at random "
                   "(two examples each; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_command)


def _command(args) -> int:
    started = time.monotonic()
    manifest = prepare_pairs(args.corpus, args.out, args.max_train, args.seed)
    print(json.dumps(manifest, indent=1))
    print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")
    return 0


def prepare_pairs(corpus: Path, out: Path, max_train: int, seed: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = {}
    for split in SPLITS:
        es, en = ParallelSide(corpus / split, "src"), ParallelSide(corpus / split, "tgt")
        keep = list(range(len(en)))
        if split == "train" and len(keep) > max_train:
            keep = sorted(rng.sample(keep, max_train))
        rows[split] = pair_rows([en.ids[i] for i in keep], [en[i] for i in keep], [es[i] for i in keep], rng)
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[split])
    threshold = _fit_length_rule(rows["train"])
    manifest = {"corpus": str(corpus), "task": "is `es` the translation of `en`? (label 1)", "chance": 0.5,
                "examples": {s: len(r) for s, r in rows.items()}, "seed": seed,
                "length_rule": {"threshold": threshold,
                                **{s: _accuracy(rows[s], threshold) for s in ("valid", "test")}}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def pair_rows(ids: list[str], en: list[str], es: list[str], rng: random.Random) -> list[dict]:
    """Two rows per sentence: with its translation, and with the translation of the sentence next to it
    in order of Spanish length (ties broken at random): a derangement whose wrong partner is as long as
    the right one, so that length alone says little."""
    n = len(ids)
    order = list(range(n))
    rng.shuffle(order)
    order.sort(key=lambda i: len(es[i]))
    other = {order[k]: order[(k + 1) % n] for k in range(n)}
    rows = [{"id": f"{ids[i]}:1", "en": en[i], "es": es[i], "label": 1} for i in range(n)]
    rows += [{"id": f"{ids[i]}:0", "en": en[i], "es": es[other[i]], "label": 0} for i in range(n) if other[i] != i]
    rng.shuffle(rows)
    return rows


def _gap(row: dict) -> float:
    return abs(math.log((len(row["es"]) + 1) / (len(row["en"]) + 1)))


def _fit_length_rule(rows: list[dict]) -> float:
    """The threshold on the length gap (label 1 at or under it) that scores best on `rows`: one sweep over
    the rows in order of their gap."""
    ranked = sorted(rows, key=_gap)
    right = sum(r["label"] == 0 for r in rows)  # threshold below every gap: everything called 0
    best, threshold = right, -1.0
    for r in ranked:
        right += 1 if r["label"] == 1 else -1
        if right > best:
            best, threshold = right, _gap(r)
    return threshold


def _accuracy(rows: list[dict], threshold: float) -> float:
    return sum((_gap(r) <= threshold) == (r["label"] == 1) for r in rows) / max(1, len(rows))
