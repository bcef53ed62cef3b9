"""Tensors that look like what a codec meets in training."""
from __future__ import annotations

import torch


def token_ids(dtype: torch.dtype = torch.int32, seed: int = 0) -> torch.Tensor:
    """(16, 128) ids in 1..29999, right-padded with zeros: 20% of the positions are padding. The ids
    follow Zipf's law (rank r drawn with probability ~ 1/r), as tokens of a frequency-ordered vocabulary do."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, 30000, dtype=torch.float64)
    ids = torch.multinomial(weights, 16 * 128, replacement=True, generator=g).view(16, 128) + 1
    lengths = 128 - torch.linspace(0, 51.2, 16).round().long()  # padding 0..51 per row, 410 in all
    return ids.masked_fill(torch.arange(128) >= lengths[:, None], 0).to(dtype)
