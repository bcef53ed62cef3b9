"""The autoregressive objective and beam search: the alternative to CMLM + mask-predict.

Teacher forcing: the decoder reads ``[CLS] w1 .. wn`` under a causal self-attention mask and
predicts ``w1 .. wn [SEP]``; [CLS] starts a translation and [SEP] ends it. Decoding is beam search
with fairseq's scoring (sum of log-probs / length) and its stopping rule (a source is done when it
has ``beam`` finished hypotheses), one token at a time with cached keys and values. Shared by the
ABNet decoder and the baseline through ``features(..., causal=True)`` (training) and
``start_decoding`` / ``next_features`` (decoding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.abnet.cmlm import CmlmDecoder, DecoderLoss


@dataclass
class DecodeState:
    """What autoregressive decoding carries from one token to the next, one row per hypothesis."""

    hidden: torch.Tensor  # (N, S, H_E)
    src_mask: torch.Tensor  # (N, S) bool
    layers: list[dict[str, torch.Tensor]]  # per decoder layer: cached tensors, rows first
    pos: int = 0  # tokens consumed so far

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (the hypotheses a beam step extends; a row may repeat)."""
        self.hidden, self.src_mask = self.hidden[index], self.src_mask[index]
        self.layers = [{k: t[index] for k, t in layer.items()} for layer in self.layers]


class ArDecoder(CmlmDecoder, Protocol):
    def start_decoding(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> DecodeState: ...

    def next_features(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor: ...  # (N, H)


def causal_mask(tgt_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask -> (B, 1, T, T) bool, True = attend: earlier positions and itself only."""
    t = tgt_mask.shape[1]
    tril = torch.ones(t, t, dtype=torch.bool, device=tgt_mask.device).tril()
    return tgt_mask.bool()[:, None, None, :] & tril


def ar_loss(dec: CmlmDecoder, hidden: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor,
            tgt_mask: torch.Tensor, *, label_smoothing: float = 0.1) -> DecoderLoss:
    """hidden (B, S, H_E), src_mask (B, S), tgt_ids/tgt_mask (B, T) with the [CLS] .. [SEP] frame."""
    tgt_in, in_mask = tgt_ids[:, :-1], tgt_mask[:, :-1].bool()
    gold, scored = tgt_ids[:, 1:], tgt_mask[:, 1:].bool()  # next token; pads are not scored
    feats = dec.features(hidden, src_mask, tgt_in, in_mask, causal=True)  # (B, T-1, H)
    logits = dec.token_logits(feats[scored])  # (N, V): the head only where there is a target
    n = int(scored.sum())
    token_loss = F.cross_entropy(logits, gold[scored], label_smoothing=label_smoothing,
                                 reduction="sum") / max(n, 1)
    return DecoderLoss(token_loss, token_loss.detach(), torch.zeros(()), n)


def _next_logp(dec: ArDecoder, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs of the token after each row's prefix, given its last token (N, 1) -> (N, V);
    frame tokens other than the end-of-sentence one can never come next."""
    logp = dec.token_logits(dec.next_features(state, tokens)).float().log_softmax(-1)
    sp = dec.specials
    banned = [i for i in dict.fromkeys(sp.as_list()) if i != sp.eos]
    logp[:, banned] = float("-inf")
    return logp


def _not(token: int, vocab: int) -> torch.Tensor:
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[token] = False
    return keep


@torch.no_grad()
def beam_search(dec: ArDecoder, hidden: torch.Tensor, src_mask: torch.Tensor, beam: int = 4,
                max_len: int | None = None, max_len_a: float | None = None, max_len_b: int = 0,
                no_repeat_ngram: int = 0) -> list[list[int]]:
    """hidden (B, S, H_E), src_mask (B, S) -> B lists of target content ids (no [CLS]/[SEP]).

    ``max_len`` caps the content length; else, as fairseq, ``max_len_a * source length + max_len_b``
    when ``max_len_a`` is given; by default source length + the decoder's ``max_delta``.
    ``no_repeat_ngram`` n > 0: no hypothesis repeats an n-gram (fairseq's --no-repeat-ngram-size).
    Rows are ``B * beam`` hypotheses, source-major; the decoder state follows them through
    ``reorder`` so each step costs one token's compute.
    """
    b, sp = hidden.shape[0], dec.specials
    src_len = src_mask.sum(1)
    if max_len is not None:
        limit = torch.full((b,), max_len)
    elif max_len_a is not None:
        limit = (max_len_a * src_len + max_len_b).ceil().long().clamp(min=1)
    else:
        limit = src_len + dec.max_delta
    state = dec.start_decoding(hidden.repeat_interleave(beam, 0), src_mask.bool().repeat_interleave(beam, 0))
    prefix = torch.full((b * beam, 1), sp.bos, dtype=torch.long)
    # Only the first beam of each source is live at the start, so step 1 picks k distinct tokens.
    scores = torch.full((b, beam), float("-inf"))
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    for t in range(1, int(limit.max()) + 2):
        logp = _next_logp(dec, state, prefix[:, -1:])  # (B*k, V)
        if no_repeat_ngram:
            _ban_repeats(logp, prefix[:, 1:], no_repeat_ngram)
        logp = logp.view(b, beam, -1)  # (B, k, V)
        at_cap = t > limit  # (B,): these sources must end now
        logp[at_cap] = logp[at_cap].masked_fill(_not(sp.eos, logp.shape[-1]), float("-inf"))
        top, flat = (scores[..., None] + logp).view(b, -1).topk(2 * beam, dim=1)  # (B, 2k)
        rows, scores = _select(top, flat, logp.shape[-1], beam, prefix, finished, sp.eos)
        if all(len(f) >= beam for f in finished):
            break
        index = torch.tensor([r for r, _ in rows])
        state.reorder(index)
        prefix = torch.cat([prefix[index], torch.tensor([[tok] for _, tok in rows])], 1)
    return [max(f, key=lambda h: h[0])[1] if f else [] for f in finished]


def _ban_repeats(logp: torch.Tensor, words: torch.Tensor, n: int) -> None:
    """In place: -inf for every token that would complete an n-gram already in its row's words (N, t)."""
    if words.shape[1] < n - 1 or n < 1:
        return
    for row, seq in enumerate(words.tolist()):
        tail = seq[len(seq) - (n - 1):] if n > 1 else []
        banned = [seq[i + n - 1] for i in range(len(seq) - n + 1) if seq[i:i + n - 1] == tail]
        if banned:
            logp[row, banned] = float("-inf")


def _select(top, flat, vocab, beam, prefix, finished, eos):
    """One beam step's bookkeeping: of each source's 2k best extensions, those ending in EOS join
    ``finished`` (scored by mean log-prob per token, EOS included), the best k others continue.
    -> (rows: (parent row, token) for all B*k slots, their scores (B, k))."""
    b = top.shape[0]
    rows, scores = [], torch.full((b, beam), float("-inf"))
    for i in range(b):
        kept = []
        for s, f in zip(top[i].tolist(), flat[i].tolist()):
            parent, token = divmod(f, vocab)
            if s == float("-inf") or len(finished[i]) >= beam or len(kept) == beam:
                break
            if token == eos:
                words = prefix[i * beam + parent, 1:].tolist()
                finished[i].append((s / (len(words) + 1), words))
            else:
                kept.append((s, parent, token))
        for j, (s, parent, token) in enumerate(kept):
            scores[i, j] = s
            rows.append((i * beam + parent, token))
        rows.extend((i * beam, eos) for _ in range(beam - len(kept)))  # dead slots, score -inf
    return rows, scores
