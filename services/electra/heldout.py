"""Held-out evaluations that can show ELECTRA-Cloud learning at the scale two CPU cores train.

All on a held-out split (whole Debian packages never seen in training): test, or valid where a setting is
chosen. Every D evaluated reads the same corrupted sequences, made once by one fixed corruptor (a generator
checkpoint and a seed), so two Ds differ only in what they learnt:
- RTD: D's ROC-AUC at telling replaced tokens from real ones over every maskable token (and its accuracy
  at p = 0.5, beside the all-"real" majority), the task it is trained on. The specials (`<s>`, `</s>`, ...)
  are left out: G never masks them, so they are real in every sequence, and a D that learnt only "a special
  is real" gained up to ~0.025 of AUC from them;
- CLM: D's accuracy at recovering the original token at the masked positions (Eq. 10's task);
- MLM: the corruptor's own accuracy at the masked positions against the unigram baseline (always the
  most frequent token of the training text): is G the well-trained model the paper distils from?
- alignment, what TRTD trains for: a held-out translation pair `<s> source </s> English </s>` (TRTD's
  layout) against the same English after another pair's source of the same length (so the English
  tokens sit at the same positions in both); D should find the English half less "replaced" next to
  its own translation. Accuracy at ranking the true pair first (chance 0.5). Beside it, a scorer that
  sees only the tokens the two halves share (numbers, names, placeholders: a copy detector) ranks the pair
  whose source shares more of the English tokens first; D must beat it, and D is also scored on the pairs
  where that scorer has no cue (both sources share as many tokens with the English half).
Each yields per-item statistics (sequences, pairs) for the paired bootstrap (services.electra.paired).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nebula.errors import DataError
from services.electra import data
from services.electra.evaluate import load_test, spread
from services.electra.losses import replaced
from services.electra.paired import Auc, Ratio
from services.models.plm import pad_rows

CHUNK = 32  # sequences per forward pass


@dataclass(frozen=True)
class FixedCorruption:
    """n held-out sequences as the corruptor left them: tokens, masked positions and originals (n, S)."""

    tokens: torch.Tensor
    at: torch.Tensor
    originals: torch.Tensor
    mlm_hits: torch.Tensor  # (n,) masked positions where G's most likely token is the original
    unigram_hits: torch.Tensor  # (n,) ... where the most frequent training token is
    masked: torch.Tensor  # (n,) masked positions per sequence
    ids: list[str]  # the sequences' example ids


def fixed_corruption(generator, sequences: int, seed: int, split_name: str = "test") -> FixedCorruption:
    """`sequences` sequences spread over the held-out split, masked and sampled by the generator stage from
    `seed` (chunk k from seed + k): the same for every D evaluated against them."""
    split = generator.corpus.splits[split_name]
    if not split.rows:
        raise DataError(f"the generator's corpus {generator.options.corpus!r} has no {split_name} sequences to "
                        "evaluate on")
    chosen = spread(range(len(split.rows)), sequences, seed)
    common, pad = most_frequent(generator), generator.specials.pad
    tokens: list[torch.Tensor] = []
    at: list[torch.Tensor] = []
    originals: list[torch.Tensor] = []
    mlm: list[torch.Tensor] = []
    unigram: list[torch.Tensor] = []
    masked: list[torch.Tensor] = []
    generator.module.eval()
    with torch.no_grad():
        for k in range(0, len(chosen), CHUNK):
            ids = split.batch(chosen[k:k + CHUNK], pad).to(generator.device)
            out = generator.corrupt(ids, seed * 1_000_003 + k)
            tokens.append(out.tokens.cpu())
            at.append(out.at.cpu())
            originals.append(ids.cpu())
            mlm.append(per_row(out.at, out.logits.argmax(-1) == out.originals))
            unigram.append(per_row(out.at, out.originals == common))
            masked.append(out.at.sum(1).double().cpu())
    width = max(t.shape[1] for t in tokens)
    return FixedCorruption(_stack(tokens, width, pad), _stack(at, width, False), _stack(originals, width, pad),
                           torch.cat(mlm), torch.cat(unigram), torch.cat(masked), [split.ids[i] for i in chosen])


def per_row(at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(B,) float64: the sum of `values` (M,), one per True of `at` (B, S) in row-major order, per row."""
    rows = at.nonzero()[:, 0]
    return torch.zeros(len(at), dtype=torch.float64, device=at.device).index_add_(0, rows, values.double()).cpu()


def _stack(chunks: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """Chunks (b, s_k) of one dtype as one (sum b, width) tensor, right-filled with `fill`."""
    out = torch.full((sum(len(c) for c in chunks), width), fill, dtype=chunks[0].dtype)
    row = 0
    for c in chunks:
        out[row:row + len(c), :c.shape[1]] = c
        row += len(c)
    return out


def most_frequent(generator) -> int:
    """The most frequent maskable id of the generator's training text: the unigram baseline's one guess."""
    rows = generator.corpus.splits["train"].rows
    counts = torch.bincount(torch.tensor([i for row in rows for i in row]), minlength=len(generator.vmap))
    counts[:max(generator.specials.as_list()) + 1] = 0  # specials are never masked
    return int(counts.argmax())


def mlm_metrics(c: FixedCorruption) -> tuple[Ratio, Ratio]:
    """(the unigram baseline, the corruptor G) as accuracies over the masked positions, per sequence."""
    return Ratio(c.unigram_hits, c.masked), Ratio(c.mlm_hits, c.masked)


@dataclass(frozen=True)
class DiscriminatorScores:
    """One D on the fixed corruption: each maskable token's RTD logit and label, per-sequence CLM hits."""

    rtd: torch.Tensor  # (T,) logits, > 0 for "replaced"
    labels: torch.Tensor  # (T,) 1 = replaced
    sequence: torch.Tensor  # (T,) which sequence each token is in
    clm_hits: torch.Tensor  # (n,)

    def auc(self) -> Auc:
        return Auc(self.rtd, self.labels, self.sequence)

    def accuracy(self) -> Ratio:
        """Tokens classified right at p = 0.5, an accuracy over every maskable token, per sequence."""
        right = ((self.rtd > 0).double() == self.labels).double()
        return Ratio(self._per_sequence(right), self._per_sequence(torch.ones_like(right)))

    def majority(self) -> Ratio:
        """The all-"real" guess: what accuracy gives for nothing (most tokens are real)."""
        return Ratio(self._per_sequence(1 - self.labels), self._per_sequence(torch.ones_like(self.labels)))

    def _per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        n = len(self.clm_hits)
        return torch.zeros(n, dtype=torch.float64).index_add_(0, self.sequence, values.double())


def score_discriminator(disc, c: FixedCorruption) -> DiscriminatorScores:
    """D (a discriminator stage, eval mode: no dropout) on every sequence of the fixed corruption."""
    rtd, labels, sequence, clm = [], [], [], []
    last_special = max(disc.specials.as_list())  # the specials are the first ids of the cut vocabulary
    disc.module.eval()
    with torch.no_grad():
        for k in range(0, len(c.tokens), CHUNK):
            tokens, at, originals = (x[k:k + CHUNK].to(disc.device) for x in (c.tokens, c.at, c.originals))
            real = tokens != disc.specials.pad
            logits, clm_logits = disc.module(tokens, real, at)
            scored = real & (originals > last_special)  # what G may mask: never <s>, </s>, ...
            rows = torch.arange(k, k + len(tokens), device=tokens.device)[:, None].expand_as(tokens)
            rtd.append(logits[scored].double().cpu())
            labels.append(replaced(tokens, originals, at)[scored].double().cpu())
            sequence.append(rows[scored].cpu())
            clm.append(per_row(at, clm_logits.argmax(-1) == originals[at]))
    return DiscriminatorScores(torch.cat(rtd), torch.cat(labels), torch.cat(sequence), torch.cat(clm))


# -- alignment ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlignmentSet:
    """n held-out pairs as TRTD sequences: each English half after its own source and after another's."""

    true: torch.Tensor  # (n, S) `<s> source </s> English </s>`
    shuffled: torch.Tensor  # (n, S) the same English after the source of pair other[i]
    english_true: torch.Tensor  # (n, S) bool: the English tokens (not the closing </s>)
    english_shuffled: torch.Tensor
    shared_true: torch.Tensor  # (n,) English tokens that also occur in the pair's own source
    shared_shuffled: torch.Tensor  # (n,) ... in the other pair's source


def alignment_set(disc, data_root: Path, pair: str, n: int, seed: int, split: str = "test") -> AlignmentSet:
    """n distinct held-out pairs of `pair` (evaluate.load_test), cut as pack_pairs cuts (half of max_len each)."""
    examples = spread(load_test(data_root, pair, split), n, seed)
    if len(examples) < 2:
        raise DataError(f"{Path(data_root) / pair}/{split} has {len(examples)} distinct pairs: alignment needs 2")
    half = disc.options.max_len // 2 - 2
    src = [r[:half] for r in data.to_model_ids(disc.vmap, data.encode(disc.tok, [s for _, s, _ in examples]))]
    eng = [r[:half] for r in data.to_model_ids(disc.vmap, data.encode(disc.tok, [t for _, _, t in examples]))]
    other = derangement([len(r) for r in src], seed)
    sp = disc.specials
    true: list[list[int]] = []
    shuffled: list[list[int]] = []
    mask_true: list[list[int]] = []
    mask_shuffled: list[list[int]] = []
    for i, english in enumerate(eng):
        for source, rows, masks in ((src[i], true, mask_true), (src[other[i]], shuffled, mask_shuffled)):
            rows.append([sp.bos, *source, sp.eos, *english, sp.eos])
            masks.append([0] * (len(source) + 2) + [1] * len(english) + [0])
    shared = [(shared_tokens(src[i], english), shared_tokens(src[other[i]], english)) for i, english in enumerate(eng)]
    return AlignmentSet(pad_rows(true, sp.pad), pad_rows(shuffled, sp.pad), pad_rows(mask_true, 0).bool(),
                        pad_rows(mask_shuffled, 0).bool(), *torch.tensor(shared, dtype=torch.float64).reshape(-1, 2).T)


def shared_tokens(source: list[int], english: list[int]) -> int:
    """How many of the English half's tokens (with repeats) also occur in the source half: all that a
    copy detector sees (numbers, names, placeholders and loanwords written alike in both languages)."""
    seen = set(source)
    return sum(token in seen for token in english)


def derangement(lengths: list[int], seed: int) -> list[int]:
    """other[i] != i for every i, and of the same length except next to a length that only one item has: a
    seeded shuffle sorted by length, then one cycle through each run of equal lengths; an item whose length no
    other has shares a run with the next item up (the last one, with the run below). Why lengths: with a source
    of another length the English half moves by the difference, and D's scores depend on position; an untrained
    D then scored 0.516 / 0.552 on validation pairs instead of 0.5, and a training D swung by ±0.05 between
    checkpoints (docs/electra.md, "Evaluation")."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    order.sort(key=lambda i: lengths[i])  # stable: shuffled within each length
    runs: list[list[int]] = []
    for i in order:
        if runs and (lengths[runs[-1][0]] == lengths[i] or len(runs[-1]) == 1):
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) > 1 and len(runs[-1]) == 1:
        last = runs.pop()  # not `runs[-2] += runs.pop()`: its -2 is resolved again after the pop
        runs[-1] += last
    other = [0] * len(lengths)
    for run in runs:
        for k, i in enumerate(run):
            other[i] = run[(k + 1) % len(run)]
    return other


def alignment_hits(disc, pairs: AlignmentSet, no_shared_cue: bool = False) -> Ratio:
    """Per pair 1 when D finds its English half less replaced (mean sigmoid of the RTD logits) next to its
    own translation than next to another, 1/2 on a tie, else 0. no_shared_cue: over the pairs whose two
    sources share as many tokens with the English half (the others count 0 of 0)."""
    true, shuffled = (_english_score(disc, x, m) for x, m in ((pairs.true, pairs.english_true),
                                                             (pairs.shuffled, pairs.english_shuffled)))
    hits = _ranked_first(-true, -shuffled)  # less replaced = ranked first
    if not no_shared_cue:
        return Ratio(hits)
    tied = (pairs.shared_true == pairs.shared_shuffled).double()
    return Ratio(hits * tied, tied)


def shared_token_hits(pairs: AlignmentSet) -> Ratio:
    """The copy detector's alignment accuracy: the pair whose source shares more English tokens first."""
    return Ratio(_ranked_first(pairs.shared_true, pairs.shared_shuffled))


def _ranked_first(true: torch.Tensor, shuffled: torch.Tensor) -> torch.Tensor:
    """(n,) 1 where the true pair scores higher, 1/2 on a tie, else 0."""
    return (true > shuffled).double() + 0.5 * (true == shuffled).double()


def _english_score(disc, rows: torch.Tensor, english: torch.Tensor) -> torch.Tensor:
    out = []
    disc.module.eval()
    with torch.no_grad():
        for k in range(0, len(rows), CHUNK):
            ids, m = rows[k:k + CHUNK].to(disc.device), english[k:k + CHUNK].to(disc.device)
            nothing = torch.zeros_like(ids, dtype=torch.bool)  # no masked positions: no CLM logits wanted
            p = torch.sigmoid(disc.module(ids, ids != disc.specials.pad, nothing)[0].double())
            out.append(((p * m).sum(1) / m.sum(1).clamp(min=1)).cpu())
    return torch.cat(out)
