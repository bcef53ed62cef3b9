"""The losses of ELECTRA-Cloud (paper §3.1, Eqs. 6, 8, 10, 11) as plain functions of logits and ids.

Kept apart from the stages so that each term can be checked against a value computed by hand
(tests/unit/test_electra_losses.py): which tokens count as replaced, that padding never counts, that
the corrective LM sees only the masked positions, and that lambda and gamma weight what they should.

Shapes: B sequences of S tokens, M masked positions over the batch (row-major order, as `at.nonzero()`),
V ids in the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def replaced(tokens: torch.Tensor, originals: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """RTD labels (B, S) float: 1 where a masked position holds a token other than the original. Eq. 8
    labels by x_corrupt_i = x_i, not by i in M: a sample that equals the original is a real token."""
    return (at & (tokens != originals)).float()


def generator_loss(logits: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
    """L_G (Eq. 6): cross-entropy of the original ids (M,) under the logits (M, V) at the masked
    positions, a mean over them (Eq. 6's sum over M, divided by |M| so that the step size does not
    depend on how many were masked)."""
    return F.cross_entropy(logits, originals)


@dataclass(frozen=True)
class DiscriminatorLoss:
    total: torch.Tensor  # lambda * rtd + gamma * clm: what the discriminator minimises (Eq. 11 less L_G)
    rtd: torch.Tensor  # L_D, Eq. 8: binary cross-entropy over the real tokens, a mean
    clm: torch.Tensor  # L_CLM, Eq. 10: cross-entropy of the originals at the masked positions, a mean


def discriminator_loss(rtd_logits: torch.Tensor, clm_logits: torch.Tensor | None, tokens: torch.Tensor,
                       originals: torch.Tensor, at: torch.Tensor, real: torch.Tensor, rtd_weight: float,
                       clm_weight: float) -> DiscriminatorLoss:
    """rtd_logits (B, S): one logit per token, > 0 for "replaced"; clm_logits (M, V) at the masked
    positions `at` (B, S) bool, row-major; tokens and originals (B, S) ids; real (B, S) bool, False on
    padding. Eq. 10 as printed omits the log and the sign of a likelihood; it is the usual -log p.
    clm_logits None: not computed (gamma = 0), L_CLM is then 0."""
    labels = replaced(tokens, originals, at)
    rtd = F.binary_cross_entropy_with_logits(rtd_logits[real], labels[real])
    # a batch with nothing masked has no CLM term; `* 0` keeps it on the autograd graph and the device
    clm = F.cross_entropy(clm_logits, originals[at]) if clm_logits is not None and at.any() else rtd_logits.sum() * 0
    return DiscriminatorLoss(rtd_weight * rtd + clm_weight * clm, rtd, clm)
