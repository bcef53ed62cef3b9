"""Held-out evaluation of a multilingual sentence encoder, for the ELECTRA-style pre-training workload.

ELECTRA and its multilingual successors are judged on XNLI: fit a classifier on English, test it on
other languages. XNLI is not available offline, so this measures the same two properties on the prepared
corpora, always on the test split (whole Debian packages never seen in training):

- retrieval: X->en accuracy@1 over n held-out translation pairs, i.e. is a sentence's nearest English
  sentence (cosine) its own translation? This asks whether the encoder aligns the languages at all.
- probe: XNLI's zero-shot transfer protocol with the source package as the label. A linear probe is
  trained on the English sentences of one half of each package and tested on the es/zh sentences of
  the other half (and on their English side, the in-language reference).

Every accuracy comes with a 95% bootstrap interval, so "pre-training helped" (format_table's "better"
column) means the intervals separate, not that two numbers differ in the third decimal. The encoder is
any callable texts -> (N, H) tensor; tokenization, batching inside a chunk and pooling are the caller's.
"""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from nebula.errors import ConfigError, DataError, StageError
from services.corpus.corpus import ParallelSide, check_aligned

Encoder = Callable[[list[str]], torch.Tensor]
Example = tuple[str, str, str]  # (package, source text, English text)

PAIRS = ("es-en", "zh-en")
CHUNK = 64  # texts per encode() call, to bound the encoder's memory
RESAMPLES = 1000
MIN_CLASSES = 4  # the automatic k keeps at least this many packages, where the split has them
MAX_CLASSES = 8  # the largest packages, beyond these the probe ignores the rest
MAX_PER_CLASS = 250  # sentences per class and half, when k is chosen automatically
PROBE_STEPS = 100  # LBFGS iterations at most
WEIGHT_DECAY = 1e-3  # on the mean cross-entropy; about scikit-learn's C=1 for ~1000 examples


def load_test(data_root: Path, pair: str, split: str = "test") -> list[Example]:
    """The test split of `pair` (or another held-out `split`) as (package, source, English), each text kept
    once (first occurrence).

    A text that occurs twice would make the "right" translation or package ambiguous, so a pair whose
    source or English text (case and spacing ignored) was already seen is dropped.
    """
    root = Path(data_root) / pair
    if not root.is_dir():
        raise DataError(f"{root} not found: run `nebula data prepare --pairs {pair} --out {Path(data_root)}` "
                        f"to build the {pair} corpus, or pass the data root that holds it")
    src, tgt = ParallelSide(root / split, "src"), ParallelSide(root / split, "tgt")
    check_aligned(src, tgt)
    return _unique([(i.split(":", 1)[0], s, t) for i, s, t in zip(src.ids, src.lines, tgt.lines)])


def _unique(examples: list[Example]) -> list[Example]:
    seen_src, seen_tgt, kept = set(), set(), []
    for package, src, tgt in examples:
        ks, kt = _key(src), _key(tgt)
        if ks not in seen_src and kt not in seen_tgt:
            kept.append((package, src, tgt))
        seen_src.add(ks)
        seen_tgt.add(kt)
    return kept


def _key(text: str) -> str:
    return " ".join(text.casefold().split())


def spread(items: Sequence, n: int, seed: int) -> list:
    """n items spread evenly over `items` (the split is grouped by package), the start drawn from `seed`."""
    if n >= len(items):
        return list(items)
    step = len(items) / n
    start = random.Random(seed).random() * step
    return [items[int(start + i * step)] for i in range(n)]


def embed(encode: Encoder, texts: list[str]) -> torch.Tensor:
    """encode(texts) in chunks of CHUNK texts, as one (N, H) float64 CPU tensor."""
    parts: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(texts), CHUNK):
            chunk = texts[start:start + CHUNK]
            out = encode(chunk)
            width = parts[0].shape[1] if parts else None
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(chunk) \
                    or (width is not None and out.shape[1] != width):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ConfigError(f"encode({len(chunk)} texts) returned {shape}: it must return one row per text, "
                                  f"shape ({len(chunk)}, H), with the same H on every call")
            parts.append(out.detach().to("cpu", torch.float64))
    features = torch.cat(parts)
    if not torch.isfinite(features).all():
        raise StageError("the encoder returned NaN or inf features: check the checkpoint and the pooling mask")
    return features


def bootstrap(values, seed: int, resamples: int = RESAMPLES) -> tuple[float, float]:
    """95% percentile interval of the mean of `values`, from `resamples` resamples with replacement."""
    v = torch.as_tensor(values, dtype=torch.float64).cpu().flatten()
    if v.numel() == 0:
        raise DataError("no values to bootstrap: the evaluation sample is empty")
    g = torch.Generator().manual_seed(seed)
    means = v[torch.randint(len(v), (resamples, len(v)), generator=g)].mean(dim=1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def retrieval(encode: Encoder, data_root: Path, pair: str, n: int = 1000, seed: int = 0) -> dict:
    """X->en accuracy@1 over n held-out pairs: is each source sentence's nearest English one its translation?"""
    sample = spread(load_test(data_root, pair), n, seed)
    if len(sample) < 2:
        raise DataError(f"{Path(data_root) / pair}/test has {len(sample)} distinct pairs: retrieval needs at least 2")
    src = F.normalize(embed(encode, [s for _, s, _ in sample]), dim=1)
    tgt = F.normalize(embed(encode, [t for _, _, t in sample]), dim=1)
    correct = _nearest_is_own(src @ tgt.T)
    return {"task": "retrieval", "pair": pair, "n": len(sample), "accuracy": correct.mean().item(),
            "interval": list(bootstrap(correct, seed)), "chance": 1 / len(sample)}


def _nearest_is_own(sim: torch.Tensor) -> torch.Tensor:
    """Per row, 1.0 when the diagonal strictly beats every other column (a tie is not a hit)."""
    own = sim.diagonal().clone()
    others = sim.clone().fill_diagonal_(float("-inf"))
    return (own > others.max(dim=1).values).double()


def probe(encode: Encoder, data_root: Path, pair: str, n_per_class: int | None = None, seed: int = 0) -> dict:
    """Zero-shot transfer: a package classifier trained on English (half A), tested on es/zh (half B).

    `n_per_class` (k) sentences per package and half; None picks k so that at least MIN_CLASSES packages
    have 2k sentences (all of them, if the split has fewer), at most MAX_PER_CLASS.
    """
    where = str(Path(data_root) / pair / "test")
    classes, half_a, half_b = probe_split(load_test(data_root, pair), n_per_class, seed, where)
    label = {package: i for i, package in enumerate(classes)}
    y_a = torch.tensor([label[p] for p, _, _ in half_a])
    y_b = torch.tensor([label[p] for p, _, _ in half_b])
    train = embed(encode, [t for _, _, t in half_a])
    mean, std = train.mean(dim=0), train.std(dim=0)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant feature stays centred, not blown up
    w, b = fit_probe((train - mean) / std, y_a, len(classes))

    def correct(texts: list[str]) -> torch.Tensor:
        return (((embed(encode, texts) - mean) / std @ w + b).argmax(dim=1) == y_b).double()

    cross, english = correct([s for _, s, _ in half_b]), correct([t for _, _, t in half_b])
    return {"task": "probe", "pair": pair, "classes": classes, "train_n": len(half_a), "test_n": len(half_b),
            "accuracy": cross.mean().item(), "interval": list(bootstrap(cross, seed)),
            "english_accuracy": english.mean().item(), "chance": 1 / len(classes)}


def probe_split(examples: list[Example], n_per_class: int | None, seed: int, where: str = "the test split"
                ) -> tuple[list[str], list[Example], list[Example]]:
    """(classes sorted by name, half A, half B): k examples of each class per half, from a seeded shuffle."""
    by_package: dict[str, list[Example]] = defaultdict(list)
    for example in examples:
        by_package[example[0]].append(example)
    ranked = sorted(by_package, key=lambda p: (-len(by_package[p]), p))
    sizes = ", ".join(f"{p} {len(by_package[p])}" for p in ranked) or "none"
    if len(ranked) < 2:
        raise DataError(f"the probe needs test sentences from at least 2 packages, {where} has {sizes}: "
                        "prepare a corpus whose test split holds several packages")
    if n_per_class is None:
        n_per_class = max(1, min(MAX_PER_CLASS, len(by_package[ranked[min(MIN_CLASSES, len(ranked)) - 1]]) // 2))
    if n_per_class < 1:
        raise ConfigError(f"n_per_class must be at least 1, got {n_per_class}")
    classes = sorted([p for p in ranked if len(by_package[p]) >= 2 * n_per_class][:MAX_CLASSES])
    if len(classes) < 2:
        raise DataError(f"the probe needs 2 packages with {2 * n_per_class} distinct test sentences each, "
                        f"{where} has {sizes}: use a smaller n_per_class")
    rng = random.Random(seed)
    half_a: list[Example] = []
    half_b: list[Example] = []
    for package in classes:
        items = list(by_package[package])
        rng.shuffle(items)
        half_a += items[:n_per_class]
        half_b += items[n_per_class:2 * n_per_class]
    return classes, half_a, half_b


def fit_probe(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression, L2 on the weights, full-batch LBFGS from zero: deterministic."""
    w = torch.zeros(x.shape[1], num_classes, dtype=x.dtype, requires_grad=True)
    b = torch.zeros(num_classes, dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=PROBE_STEPS, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, y) + WEIGHT_DECAY * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def evaluate_all(encode: Encoder, data_root: Path, pairs: Sequence[str] = PAIRS, n: int = 1000,
                 seed: int = 0) -> list[dict]:
    """retrieval and probe rows for each pair whose directory exists under data_root."""
    present = [pair for pair in pairs if (Path(data_root) / pair).is_dir()]
    if not present:
        raise DataError(f"none of {', '.join(pairs)} found under {data_root}: run "
                        f"`nebula data prepare --pairs {','.join(pairs)} --out {Path(data_root)}`")
    return [row for pair in present
            for row in (retrieval(encode, data_root, pair, n, seed), probe(encode, data_root, pair, seed=seed))]


def format_table(rows_before: list[dict], rows_after: list[dict]) -> str:
    """Untrained vs pre-trained, one line per (task, pair); better = the intervals separate upwards."""
    before = {(r["task"], r["pair"]): r for r in rows_before}
    after = {(r["task"], r["pair"]): r for r in rows_after}
    keys = list(before) + [k for k in after if k not in before]
    lines = [("task", "pair", "chance", "untrained", "pre-trained", "better")]
    for task, pair in keys:
        old, new = before.get((task, pair)), after.get((task, pair))
        chance = (old or new)["chance"]
        better = old is not None and new is not None and new["interval"][0] > old["interval"][1]
        lines.append((task, pair, f"{chance:.3f}", _cell(old), _cell(new), "yes" if better else "no"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    lo, hi = row["interval"]
    return f"{row['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"
