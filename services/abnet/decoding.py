"""Mask-Predict decoding (Ghazvininejad et al. 2019) with a length beam; detokenising; BLEU.

For each source: take the top-``length_beam`` predicted lengths, start from all-[MASK] canvases
of those lengths, predict every token, then for T-1 more iterations re-mask the n = N (T-t)/T
least confident tokens and predict them again. The candidate with the best average log-prob wins.
"""
from __future__ import annotations

import sacrebleu
import torch
from tokenizers import Tokenizer

from services.abnet.cmlm import CmlmDecoder, lengths_from_classes
from services.models.vocab import VocabMap


def _canvas(lengths: torch.Tensor, dec: CmlmDecoder) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """lengths (N,) -> ids (N, L+2) [CLS] [MASK]*n [SEP] [PAD].., mask, content positions."""
    sp = dec.specials
    width = int(lengths.max()) + 2
    pos = torch.arange(width)[None, :]  # (1, W)
    n = lengths[:, None]  # (N, 1)
    content = (pos >= 1) & (pos <= n)
    ids = torch.full((len(lengths), width), sp.pad, dtype=torch.long)
    ids[:, 0] = sp.bos
    ids[content] = sp.mask
    ids[pos == n + 1] = sp.eos
    return ids, pos <= n + 1, content


def _predict(dec: CmlmDecoder, hidden, src_mask, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Best non-special token and its log-prob at every position: (N, W) each."""
    logp = dec.token_logits(dec.features(hidden, src_mask, ids, mask)).log_softmax(-1)
    banned = list(dict.fromkeys(dec.specials.as_list()))
    logp[..., banned] = float("-inf")  # a translation never contains frame or mask tokens
    scores, tokens = logp.max(-1)
    return tokens, scores


def _refine(dec, hidden, src_mask, ids, mask, content, lengths, iterations):
    """The mask-predict loop; returns final ids and per-token log-probs (N, W)."""
    ids = ids.clone()
    tokens, scores = _predict(dec, hidden, src_mask, ids, mask)
    ids[content], probs = tokens[content], scores.masked_fill(~content, 0.0)
    for t in range(1, iterations):
        n_mask = (lengths.float() * (iterations - t) / iterations).long()  # (N,)
        if int(n_mask.max()) == 0:
            break
        conf = probs.masked_fill(~content, float("inf"))
        rank = conf.argsort(1).argsort(1)  # 0 = least confident
        remask = content & (rank < n_mask[:, None])
        ids[remask] = dec.specials.mask
        tokens, scores = _predict(dec, hidden, src_mask, ids, mask)
        ids[remask], probs[remask] = tokens[remask], scores[remask]
    return ids, probs


@torch.no_grad()
def mask_predict(dec: CmlmDecoder, hidden: torch.Tensor, src_mask: torch.Tensor,
                 iterations: int = 10, length_beam: int = 4) -> list[list[int]]:
    """hidden (B, S, H_E), src_mask (B, S) -> B lists of target content ids (decoder id space)."""
    b = hidden.shape[0]
    k = min(length_beam, 2 * dec.max_delta + 1)
    classes = dec.length_logits(hidden, src_mask).topk(k, dim=-1).indices  # (B, k)
    lengths = lengths_from_classes(src_mask, classes, dec.max_delta).reshape(-1)  # (B*k,)
    hid = hidden.repeat_interleave(k, 0)  # (B*k, S, H_E)
    smask = src_mask.bool().repeat_interleave(k, 0)
    ids, mask, content = _canvas(lengths, dec)
    ids, probs = _refine(dec, hid, smask, ids, mask, content, lengths, iterations)
    avg = (probs.sum(1) / lengths).view(b, k)  # mean log-prob per candidate
    best = avg.argmax(1) + torch.arange(b) * k  # (B,) row in the B*k candidates
    return [ids[r][content[r]].tolist() for r in best.tolist()]


def detokenize(ids: list[int], tokenizer: Tokenizer, vmap: VocabMap | None = None) -> str:
    """Model ids -> text: back to tokenizer ids, then the tokenizer's own decoder
    (for wordpiece: joins ``##`` pieces, drops specials, tidies spaces before punctuation)."""
    old = ids if vmap is None else vmap.to_old(torch.tensor(ids, dtype=torch.long)).tolist()
    return tokenizer.decode(old, skip_special_tokens=True)


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Case-insensitive corpus BLEU, as the paper reports (ABNet's metric configuration)."""
    return sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True).score
