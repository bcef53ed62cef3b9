"""ABNet (Guo et al. 2020) split across two sites, as ABNet-Cloud (Nebula-I §3.2).

    site a: SourceEncoder  src (B, S) -> H_E (B, S, H_E)  ── H_E crosses the WAN ─►
    site b: TargetDecoder  (H_E, src_mask, tgt) -> CMLM loss; dL/dH_E goes back ◄──

Each side is a frozen PLM with a trainable adapter after every layer (eq. 12 and 13); the
decoder also owns the length predictor and the output head, so the encoder needs nothing from
site b but the gradient of its output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.abnet.adapters import DecoderAdapter, EncoderAdapter
from services.abnet.autoregressive import DecodeState, causal_mask
from services.abnet.cmlm import DecoderLoss
from services.abnet.objective import Objective, check_objective
from services.models.plm import BertModel, Pretrained, SpecialIds
from services.models.vocab import VocabMap, cut_embeddings


@dataclass(frozen=True, kw_only=True)
class AbnetConfig:
    enc_adapter_dim: int = 512  # paper: 512 between the two feed-forward layers
    dec_adapter_ffn: int = 1024
    dec_adapter_heads: int = 12
    adapter_dropout: float = 0.1
    # Dropout inside the frozen PLMs while training. 0 keeps them deterministic and ~25% faster
    # on CPU (fused attention); BERT's own 0.1 is the other sensible choice.
    plm_dropout: float = 0.0
    max_length_delta: int = 32  # target length predicted as src_len + [-32, 32]
    label_smoothing: float = 0.1
    length_loss_weight: float = 0.1
    objective: str = "cmlm"  # or "ar": services/abnet/objective.py
    adapter_layers: int | None = None  # adapters after the top n PLM layers only; None: all (the paper)
    cross_init_std: float = 0.02  # the cross-attention output projection's initial weights (adapters.py)

    def __post_init__(self):
        check_objective(self.objective)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _adapted(layers: int, cfg: AbnetConfig, make) -> nn.ModuleList:
    """One module per PLM layer: `make()` for the top `cfg.adapter_layers` layers (all when None),
    NoAdapter below them, so checkpoints keep one entry per layer index."""
    top = layers if cfg.adapter_layers is None else min(cfg.adapter_layers, layers)
    return nn.ModuleList(make() if i >= layers - top else NoAdapter() for i in range(layers))


class NoAdapter(nn.Module):
    """A PLM layer without an adapter: its output passes unchanged (the decoder's context is ignored)."""

    def forward(self, h: torch.Tensor, *context) -> torch.Tensor:
        return h


class SourceEncoder(nn.Module):
    """Site a: frozen source PLM, an EncoderAdapter after each layer: H_{l+1} = A(PLM_l(H_l))."""

    def __init__(self, plm: BertModel, cfg: AbnetConfig):
        super().__init__()
        self.plm = plm.freeze().set_dropout(cfg.plm_dropout)
        h = plm.cfg.hidden_size
        self.adapters = _adapted(len(plm.layers), cfg,
                                 lambda: EncoderAdapter(h, cfg.enc_adapter_dim, cfg.adapter_dropout))
        self.hidden_size = h

    def forward(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src_ids, src_mask (B, S) -> H_E (B, S, H). Frozen layers before the first adapter
        build no autograd graph, since nothing they touch requires grad."""
        x, am = self.plm.embeddings(src_ids), BertModel.attention_mask(src_mask)
        for layer, adapter in zip(self.plm.layers, self.adapters):
            x = adapter(layer(x, am))
        return x

    def trainable_parameters(self) -> list[nn.Parameter]:
        return _trainable(self)


class LengthPredictor(nn.Module):
    """Masked mean of H_E -> logits over the length offset classes (B, 2D+1)."""

    def __init__(self, enc_hidden: int, max_delta: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(enc_hidden, enc_hidden), nn.GELU(),
                                 nn.Linear(enc_hidden, 2 * max_delta + 1))

    def forward(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        m = src_mask.to(hidden.dtype)[..., None]  # (B, S, 1)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)  # (B, H_E)
        return self.net(pooled)


class TargetDecoder(Objective, nn.Module):
    """Site b: frozen target PLM, a cross-attention adapter after each layer, the length predictor
    (CMLM only) and a trainable output head initialised from the word embeddings. The PLM attends
    both ways for CMLM and only leftwards for the autoregressive objective."""

    def __init__(self, plm: BertModel, specials: SpecialIds, enc_hidden: int, cfg: AbnetConfig):
        super().__init__()
        self.plm = plm.freeze().set_dropout(cfg.plm_dropout)
        self.cfg, self.specials, self.max_delta = cfg, specials, cfg.max_length_delta
        h = plm.cfg.hidden_size
        self.adapters = _adapted(len(plm.layers), cfg, lambda: DecoderAdapter(
            h, enc_hidden, cfg.dec_adapter_heads, cfg.dec_adapter_ffn, cfg.adapter_dropout, cfg.cross_init_std))
        if cfg.objective == "cmlm":
            self.length = LengthPredictor(enc_hidden, cfg.max_length_delta)
        emb = plm.embeddings.word_embeddings.weight  # (V, H)
        self.head = nn.Linear(h, emb.shape[0])
        with torch.no_grad():
            self.head.weight.copy_(emb)
            self.head.bias.zero_()

    def features(self, hidden: torch.Tensor, src_mask: torch.Tensor, tgt_in: torch.Tensor,
                 tgt_mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """H_D_{l+1} = A(PLM_l(H_D_l), H_E, H_E); returns (B, T, H)."""
        am = causal_mask(tgt_mask) if causal else BertModel.attention_mask(tgt_mask)
        x = self.plm.embeddings(tgt_in)
        src_mask = src_mask.bool()
        for layer, adapter in zip(self.plm.layers, self.adapters):
            x = adapter(layer(x, am), hidden, src_mask)
        return x

    def start_decoding(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> DecodeState:
        """Autoregressive decoding state: H_E's cross-attention keys/values, computed once."""
        layers = [dict(zip(("ck", "cv"), a.attn.project(hidden))) if isinstance(a, DecoderAdapter) else {}
                  for a in self.adapters]
        return DecodeState(hidden, src_mask.bool(), layers)

    def next_features(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """The next token of every row, tokens (N, 1) -> its features (N, H), reusing the cached
        self-attention keys/values of the earlier tokens: the same as ``features(..., causal=True)``
        at the last position, in time linear rather than quadratic in the length."""
        x = self.plm.embeddings(tokens, start=state.pos)
        for layer, adapter, cache in zip(self.plm.layers, self.adapters, state.layers):
            x = adapter(layer(x, None, cache), state.hidden, state.src_mask, (cache.get("ck"), cache.get("cv")))
        state.pos += 1
        return x[:, -1]

    def token_logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head(feats)  # (..., V)

    def length_logits(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        return self.length(hidden, src_mask)  # (B, 2D+1)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return _trainable(self)


def build_source_encoder(pre: Pretrained, cfg: AbnetConfig,
                         vmap: VocabMap | None = None) -> SourceEncoder:
    """Site a's model: the PLM (vocabulary cut to ``vmap`` if given) plus fresh adapters."""
    if vmap is not None:
        cut_embeddings(pre.model, vmap)
    return SourceEncoder(pre.model, cfg)


def build_target_decoder(pre: Pretrained, cfg: AbnetConfig, enc_hidden: int,
                         vmap: VocabMap | None = None) -> TargetDecoder:
    """Site b's model; ``enc_hidden`` is the width of H_E that site a will send."""
    specials = pre.specials
    if vmap is not None:
        cut_embeddings(pre.model, vmap)
        specials = vmap.specials(pre.specials)
    return TargetDecoder(pre.model, specials, enc_hidden, cfg)


@dataclass
class Batch:
    src_ids: torch.Tensor  # (B, S) source model ids
    src_mask: torch.Tensor  # (B, S) bool
    tgt_ids: torch.Tensor  # (B, T) target model ids, [CLS] .. [SEP]
    tgt_mask: torch.Tensor  # (B, T) bool


def train_step(encoder: nn.Module, decoder: nn.Module, batch: Batch,
               opt_e: torch.optim.Optimizer, opt_d: torch.optim.Optimizer,
               generator: torch.Generator | None = None) -> DecoderLoss:
    """One unpipelined step doing exactly what the two sites do, in one process.

    Site a runs the encoder; H_E is cut from its graph as site b receives it; site b computes
    the loss and back-propagates to H_E; site a back-propagates that gradient into its adapters.
    Works for ``SourceEncoder``/``TargetDecoder`` and for the baseline's pair alike.
    """
    hidden = encoder(batch.src_ids, batch.src_mask)  # (B, S, H_E) site a
    received = hidden.detach().requires_grad_()  # what site b gets over the WAN
    out = decoder.loss(received, batch.src_mask, batch.tgt_ids, batch.tgt_mask, generator)
    opt_e.zero_grad(set_to_none=True)
    opt_d.zero_grad(set_to_none=True)
    out.loss.backward()  # site b: adapter, head, length grads + dL/dH_E
    hidden.backward(received.grad)  # site a: gradient that came back over the WAN
    opt_d.step()
    opt_e.step()
    return out
