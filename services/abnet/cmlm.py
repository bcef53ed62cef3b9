"""The conditional masked-LM objective (Mask-Predict, Ghazvininejad et al. 2019), as ABNet trains.

Mask a uniformly random number (1..n) of the n target tokens, predict them from the rest and the
source; predict the target length as an offset from the source length. Shared by the ABNet
decoder and the from-scratch baseline through the small ``CmlmDecoder`` interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.models.plm import SpecialIds


class CmlmDecoder(Protocol):
    specials: SpecialIds  # in the decoder's (possibly cut) id space
    max_delta: int  # length classes are tgt_len - src_len in [-max_delta, max_delta]

    def features(self, hidden: torch.Tensor, src_mask: torch.Tensor, tgt_in: torch.Tensor,
                 tgt_mask: torch.Tensor, causal: bool = False) -> torch.Tensor: ...  # (B, T, H)

    def token_logits(self, feats: torch.Tensor) -> torch.Tensor: ...  # (..., V)

    def length_logits(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DecoderLoss:
    """What either objective returns (the autoregressive one has no length loss: it is 0)."""

    loss: torch.Tensor  # scalar to back-propagate: token loss + weight * length loss
    token_loss: torch.Tensor  # label-smoothed CE per masked token
    length_loss: torch.Tensor
    n_tokens: int  # positions scored: masked (CMLM) or all (autoregressive)


def content_positions(tgt_ids: torch.Tensor, tgt_mask: torch.Tensor,
                      specials: SpecialIds) -> torch.Tensor:
    """(B, T) bool: real target tokens, i.e. not padding and not the [CLS]/[SEP] frame."""
    return tgt_mask.bool() & (tgt_ids != specials.bos) & (tgt_ids != specials.eos)


def random_mask(content: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, T) bool: per row, k ~ U{1..n} of its n content positions, chosen uniformly."""
    n = content.sum(1)  # (B,)
    k = (torch.rand(n.shape, generator=generator) * n).floor().long() + 1  # (B,) in 1..n
    noise = torch.rand(content.shape, generator=generator).masked_fill(~content, 2.0)
    rank = noise.argsort(1).argsort(1)  # (B, T) position's rank among the row's noise
    return content & (rank < k[:, None])


def length_classes(src_mask: torch.Tensor, n_tgt: torch.Tensor, max_delta: int) -> torch.Tensor:
    """Target-length class: (n_tgt - n_src) clamped to [-D, D], shifted to [0, 2D]."""
    delta = n_tgt - src_mask.sum(1)
    return delta.clamp(-max_delta, max_delta) + max_delta


def lengths_from_classes(src_mask: torch.Tensor, classes: torch.Tensor,
                         max_delta: int) -> torch.Tensor:
    """Inverse of length_classes; classes (B, k) -> content lengths (B, k), at least 1."""
    return (src_mask.sum(1, keepdim=True) + classes - max_delta).clamp(min=1)


def cmlm_loss(dec: CmlmDecoder, hidden: torch.Tensor, src_mask: torch.Tensor,
              tgt_ids: torch.Tensor, tgt_mask: torch.Tensor, *, label_smoothing: float = 0.1,
              length_weight: float = 0.1,
              generator: torch.Generator | None = None) -> DecoderLoss:
    """hidden (B, S, H_E), src_mask (B, S), tgt_ids/tgt_mask (B, T) with the [CLS] .. [SEP] frame."""
    content = content_positions(tgt_ids, tgt_mask, dec.specials)
    masked = random_mask(content, generator)
    tgt_in = tgt_ids.masked_fill(masked, dec.specials.mask)
    feats = dec.features(hidden, src_mask, tgt_in, tgt_mask)  # (B, T, H)
    # Score only the masked positions: the output head is the widest matmul in the decoder.
    logits = dec.token_logits(feats[masked])  # (N, V)
    n_masked = int(masked.sum())
    # Sum / count rather than mean: a batch of empty targets gives 0, not NaN.
    token_loss = F.cross_entropy(logits, tgt_ids[masked], label_smoothing=label_smoothing,
                                 reduction="sum") / max(n_masked, 1)
    classes = length_classes(src_mask, content.sum(1), dec.max_delta)
    length_loss = F.cross_entropy(dec.length_logits(hidden, src_mask), classes)
    return DecoderLoss(token_loss + length_weight * length_loss, token_loss.detach(),
                      length_loss.detach(), n_masked)
