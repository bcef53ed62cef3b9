"""ELECTRA-Cloud's losses (services/electra/losses.py) against values computed by hand on a tiny batch.

Two sequences of four tokens, the first ending in padding; three masked positions: (0, 1) replaced by
another token, (1, 1) where the generator sampled the original, (1, 3) replaced. With the logits below:
- L_D = (4 ln 2 + ln 4/3 + ln 4 + ln 4) / 7 = (10 ln 2 - ln 3) / 7 over the 7 real tokens: a pad with
  logit 50 would add ~50, and labelling (1, 1) "replaced" (because it was masked) would give ln 4/3 there;
- L_CLM = (ln 2 + ln 3/2 + ln 4/3) / 3 at the masked positions' originals: the corrupted tokens as
  targets, or any unmasked position, would give other values.
"""
import math

import pytest
import torch

from services.electra.losses import discriminator_loss, generator_loss, replaced

LN2, LN3 = math.log(2), math.log(3)
V = 30
TOKENS = torch.tensor([[11, 12, 13, 0], [21, 22, 23, 25]])  # corrupted; 0 is padding
ORIGINALS = torch.tensor([[11, 15, 13, 0], [21, 22, 23, 24]])
AT = torch.tensor([[False, True, False, False], [False, True, False, True]])
REAL = TOKENS != 0
RTD = torch.tensor([[0.0, LN3, 0.0, 50.0], [0.0, LN3, 0.0, -LN3]])
L_D = (10 * LN2 - LN3) / 7
L_CLM = (LN2 + math.log(3 / 2) + math.log(4 / 3)) / 3  # = ln 4 / 3


def clm_logits() -> torch.Tensor:
    """(3, V) at the masked positions, row-major: p(original) = 1/2, 2/3 and 3/4."""
    logits = torch.zeros(3, V)
    logits[0, 15] = math.log(29)  # 29 / (29 + 29) = 1/2
    logits[1, 22] = math.log(58)  # 58 / (58 + 29) = 2/3
    logits[2, 24] = math.log(87)  # 87 / (87 + 29) = 3/4
    return logits


def losses(rtd_weight=50.0, clm_weight=1.0, rtd=RTD, originals=ORIGINALS):
    return discriminator_loss(rtd, clm_logits(), TOKENS, originals, AT, REAL, rtd_weight, clm_weight)


def test_a_sample_equal_to_the_original_is_real_and_only_masked_positions_can_be_replaced():
    assert replaced(TOKENS, ORIGINALS, AT).tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    # an unmasked position whose id differs from `originals` (never sent so) is still not "replaced"
    shifted = replaced(TOKENS, ORIGINALS + 1, AT)  # the labels follow the ids: now (1, 1) differs, (1, 3) not
    assert shifted.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]


def test_rtd_and_clm_equal_the_hand_computed_values():
    out = losses()
    assert out.rtd.item() == pytest.approx(L_D, abs=1e-6)
    assert out.clm.item() == pytest.approx(L_CLM, abs=1e-6)
    assert out.total.item() == pytest.approx(50 * L_D + L_CLM, abs=1e-5)


@pytest.mark.parametrize("rtd_weight, clm_weight", [(50.0, 1.0), (2.0, 3.0), (0.0, 1.0), (1.0, 0.0)])
def test_lambda_weights_rtd_and_gamma_weights_clm(rtd_weight, clm_weight):
    assert losses(rtd_weight, clm_weight).total.item() == pytest.approx(rtd_weight * L_D + clm_weight * L_CLM,
                                                                        abs=1e-5)


def test_padding_never_counts():
    other = RTD.clone()
    other[0, 3] = -80.0  # the pad's logit
    assert losses(rtd=other).rtd.item() == pytest.approx(L_D, abs=1e-6)


def test_clm_reads_only_the_masked_positions():
    unmasked = ORIGINALS.clone()
    unmasked[~AT] = 7  # what an unmasked position says it was: never a CLM target
    assert losses(originals=unmasked).clm.item() == pytest.approx(L_CLM, abs=1e-6)
    masked = ORIGINALS.clone()
    masked[1, 1] = 9  # a masked original: the CLM target, p = 1 / 87 (and now a replaced token)
    assert losses(originals=masked).clm.item() == pytest.approx((LN2 + math.log(87) + math.log(4 / 3)) / 3,
                                                                abs=1e-6)


def test_nothing_masked_leaves_rtd_alone_and_clm_zero_with_a_gradient_path():
    rtd = torch.zeros(2, 4)
    rtd[0, 1], rtd[0, 3] = LN3, 50.0
    rtd.requires_grad_()
    out = discriminator_loss(rtd, torch.zeros(0, V), TOKENS, ORIGINALS, torch.zeros_like(AT), REAL, 50.0, 1.0)
    assert out.clm.item() == 0.0
    assert out.rtd.item() == pytest.approx(8 * LN2 / 7, abs=1e-6)  # (0, 1): ln 4, not ln 4/3
    out.total.backward()
    assert rtd.grad is not None and rtd.grad[0, 3] == 0  # nothing flows to the pad


def test_generator_loss_is_the_mean_cross_entropy_at_the_masked_positions():
    logits = torch.zeros(2, 4)
    logits[0, 2] = math.log(3)  # p = 3 / 6 = 1/2
    # p = 1/2 at row 0's original, 1/4 at row 1's (uniform over 4 ids)
    assert generator_loss(logits, torch.tensor([2, 1])).item() == pytest.approx((LN2 + math.log(4)) / 2, abs=1e-6)


def test_gamma_zero_skips_the_corrective_lm_without_changing_rtd():
    out = discriminator_loss(RTD.clone().requires_grad_(), None, TOKENS, ORIGINALS, AT, REAL, 50.0, 0.0)
    assert out.clm.item() == 0 and out.total.item() == pytest.approx(50 * L_D, abs=1e-5)
    out.total.backward()  # the skipped term stays on the graph: a rank with gamma = 0 still steps
