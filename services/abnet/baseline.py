"""From-scratch Transformer for the paper's Table 2 comparison ("Transformer-base" row).

Same objective and decoding as the ABNet decoder it is compared with (``objective``: CMLM or
autoregressive), same tokenizers and cut vocabularies, so only the pre-trained knowledge differs. Everything trains; the
default size gives about as many trainable parameters as ABNet's adapters + head (see
docs/abnet.md). The encoder/decoder split and method names match ``SourceEncoder`` /
``TargetDecoder``, so ``train_step`` and the two-site services run it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from services.abnet.autoregressive import DecodeState
from services.abnet.model import LengthPredictor
from services.abnet.objective import Objective, check_objective
from services.models.plm import SpecialIds


@dataclass(frozen=True, kw_only=True)
class BaselineConfig:
    d_model: int = 384
    heads: int = 6
    ffn: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    dropout: float = 0.1
    max_positions: int = 256
    max_length_delta: int = 32
    label_smoothing: float = 0.1
    length_loss_weight: float = 0.1
    objective: str = "cmlm"  # or "ar": services/abnet/objective.py

    def __post_init__(self):
        check_objective(self.objective)


class _Embed(nn.Module):
    """Scaled token embedding + learned positions, (B, S) -> (B, S, d)."""

    def __init__(self, vocab: int, cfg: BaselineConfig, pad: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, cfg.d_model, padding_idx=pad)
        nn.init.normal_(self.tokens.weight, std=cfg.d_model ** -0.5)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.tokens(ids) * self.scale + self.positions(pos))


class BaselineEncoder(nn.Module):
    def __init__(self, vocab: int, pad: int, cfg: BaselineConfig):
        super().__init__()
        self.embed = _Embed(vocab, cfg, pad)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, cfg.ffn, cfg.dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, cfg.enc_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.hidden_size = cfg.d_model

    def forward(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.embed(src_ids), src_key_padding_mask=~src_mask.bool())
        return self.norm(x)  # (B, S, d)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class BaselineDecoder(Objective, nn.Module):
    """Transformer decoder with cross-attention (self-attention both ways for CMLM, leftwards for
    the autoregressive objective); tied output head."""

    def __init__(self, vocab: int, specials: SpecialIds, cfg: BaselineConfig):
        super().__init__()
        self.cfg, self.specials, self.max_delta = cfg, specials, cfg.max_length_delta
        self.embed = _Embed(vocab, cfg, specials.pad)
        layer = nn.TransformerDecoderLayer(cfg.d_model, cfg.heads, cfg.ffn, cfg.dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.layers = nn.TransformerDecoder(layer, cfg.dec_layers)
        self.norm = nn.LayerNorm(cfg.d_model)
        if cfg.objective == "cmlm":
            self.length = LengthPredictor(cfg.d_model, cfg.max_length_delta)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def features(self, hidden, src_mask, tgt_in, tgt_mask, causal: bool = False) -> torch.Tensor:
        t = tgt_in.shape[1]  # nn.Transformer masks say True = blocked
        future = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).triu(1) if causal else None
        x = self.layers(self.embed(tgt_in), hidden, tgt_mask=future, tgt_is_causal=causal,
                        tgt_key_padding_mask=~tgt_mask.bool(), memory_key_padding_mask=~src_mask.bool())
        return self.norm(x)  # (B, T, d)

    def start_decoding(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> DecodeState:
        return DecodeState(hidden, src_mask.bool(), [{} for _ in self.layers.layers])

    def next_features(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N, 1) -> (N, d): each pre-LN ``nn.TransformerDecoderLayer`` step by step, its
        self-attention reading the cached normed inputs of the earlier positions. Eval mode only
        (the layers' dropouts are skipped)."""
        if self.training:
            raise RuntimeError("incremental decoding runs in eval mode: call .eval() first")
        pos = torch.arange(state.pos, state.pos + 1, device=tokens.device)
        x = self.embed.tokens(tokens) * self.embed.scale + self.embed.positions(pos)  # (N, 1, d)
        memory, blocked = state.hidden, ~state.src_mask
        for layer, cache in zip(self.layers.layers, state.layers):
            h = layer.norm1(x)
            cache["h"] = torch.cat([cache["h"], h], 1) if "h" in cache else h
            x = x + layer.self_attn(h, cache["h"], cache["h"], need_weights=False)[0]
            x = x + layer.multihead_attn(layer.norm2(x), memory, memory, key_padding_mask=blocked,
                                         need_weights=False)[0]
            x = x + layer.linear2(layer.activation(layer.linear1(layer.norm3(x))))
        state.pos += 1
        return self.norm(x)[:, -1]

    def token_logits(self, feats: torch.Tensor) -> torch.Tensor:
        return feats @ self.embed.tokens.weight.T + self.bias  # (..., V), tied to the input

    def length_logits(self, hidden: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        return self.length(hidden, src_mask)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def build_baseline(cfg: BaselineConfig, src_vocab: int, src_pad: int, tgt_vocab: int,
                   tgt_specials: SpecialIds) -> tuple[BaselineEncoder, BaselineDecoder]:
    """Vocabulary sizes and specials in model id space (after any vocabulary cut)."""
    return (BaselineEncoder(src_vocab, src_pad, cfg),
            BaselineDecoder(tgt_vocab, tgt_specials, cfg))
