"""Which objective a decoder trains with and how it decodes: ``objective = "cmlm" | "ar"``.

- ``cmlm``: conditional masked LM, mask-predict decoding with a length beam (ABNet, the paper).
- ``ar``: left-to-right teacher forcing, beam search (docs/abnet.md says why it is the default
  of the job files: it reaches usable BLEU in far fewer steps, which a CPU site can afford).
"""
from __future__ import annotations

import torch

from nebula.errors import ConfigError
from services.abnet.autoregressive import ar_loss, beam_search
from services.abnet.cmlm import DecoderLoss, cmlm_loss
from services.abnet.decoding import mask_predict

OBJECTIVES = ("cmlm", "ar")


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise ConfigError(f"objective = {name!r}: use \"cmlm\" (masked LM, mask-predict decoding, as "
                          "ABNet) or \"ar\" (autoregressive, beam search)")
    return name


class Objective:
    """Mixin for TargetDecoder and BaselineDecoder: ``loss`` and ``decode`` by ``cfg.objective``.
    The class provides ``cfg`` (objective, label_smoothing, length_loss_weight), ``specials``,
    ``max_delta``, ``features``, ``token_logits`` and, for CMLM, ``length_logits``."""

    @property
    def autoregressive(self) -> bool:
        return self.cfg.objective == "ar"

    def loss(self, hidden: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor,
             tgt_mask: torch.Tensor, generator: torch.Generator | None = None) -> DecoderLoss:
        hidden = hidden.float()  # H_E may arrive in a codec's fp16/bf16
        if self.autoregressive:
            return ar_loss(self, hidden, src_mask, tgt_ids, tgt_mask,
                           label_smoothing=self.cfg.label_smoothing)
        return cmlm_loss(self, hidden, src_mask, tgt_ids, tgt_mask,
                         label_smoothing=self.cfg.label_smoothing,
                         length_weight=self.cfg.length_loss_weight, generator=generator)

    @torch.no_grad()
    def decode(self, hidden: torch.Tensor, src_mask: torch.Tensor, iterations: int = 10,
               beam: int = 4, **search) -> list[list[int]]:
        """-> target content ids per source. ``beam``: hypotheses (ar) or lengths (cmlm) kept;
        ``iterations``: mask-predict passes (cmlm only); ``search``: beam_search's length cap and
        repeat ban (ar only)."""
        hidden = hidden.float()
        if self.autoregressive:
            return beam_search(self, hidden, src_mask, beam=beam, **search)
        return mask_predict(self, hidden, src_mask, iterations=iterations, length_beam=beam)
