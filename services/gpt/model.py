"""A small GPT (pre-LN, rotary positions, GELU MLP) and the part of it one pipeline stage holds.

A stage holds blocks [first, last) of the n_layer; the first stage also the token embedding, the
last the final LayerNorm and the output head. What crosses a boundary is either the residual stream
itself (`bottleneck = 0`: (B, T, d)) or, with `bottleneck = k`, a learned code of it, (B, T, k):

    sender:    c  = W_down · LN(h)                    (B, T, k)   the only tensor on the wire
    receiver:  h' = E_stage[token] + W_up · c         (B, T, d)

The token ids are not sent: every stage reads them from its own copy of the data, by example id, so
the receiver rebuilds the token's part of the residual stream with an embedding of its own
(`reembed`) and the wire carries only what the context added. The code's gradient dL/dc = W_up^T ·
dL/dh' is exact (k wide too). With rotary positions nothing positional lives in the stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GptConfig:
    vocab_size: int = 8192
    d_model: int = 256
    n_head: int = 4
    n_layer: int = 8
    seq_len: int = 256
    mlp_ratio: int = 4


def rotary(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (T, head_dim / 2) of rotary position embeddings (Su et al. 2021)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd) rotated pairwise by position."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: GptConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos[:T], sin[:T]), rotate(k, cos[:T], sin[:T])  # (B, H, T, hd)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GptPart(nn.Module):
    """Blocks [first, last) of the model; `embed`: the token embedding (first stage); `head`: the final
    LayerNorm and output head (last stage); `code_in`/`code_out`: the width of the code received / sent
    (0: the residual stream itself, or nothing at the model's ends); `stream_embed`: a receiver of the
stream itself adds its own embedding of the tokens to it (the code's tables without the code)."""

    def __init__(self, cfg: GptConfig, first: int, last: int, *, embed: bool, head: bool, code_in: int = 0,
                 code_out: int = 0, reembed: bool = True, tie: bool = False, stream_embed: bool = False):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        d = cfg.d_model
        self.stream_embed = stream_embed and not code_in and not embed
        self.embed = nn.Embedding(cfg.vocab_size, d) if embed or (code_in and reembed) or self.stream_embed else None
        self.code_up = nn.Linear(code_in, d, bias=False) if code_in else None
        self.code_ln = nn.LayerNorm(d) if code_out else None
        self.code_down = nn.Linear(d, code_out, bias=False) if code_out else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(first, last))
        self.ln_f = nn.LayerNorm(d) if head else None
        self.head = nn.Linear(d, cfg.vocab_size, bias=False) if head else None
        if tie and self.head is not None and self.embed is not None:
            self.head.weight = self.embed.weight
        cos, sin = rotary(cfg.seq_len, d // cfg.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaling of the projections that write to the stream
            for proj in (block.proj, block.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, received: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64; received (B, T, d or k) from the previous stage (None at the first) ->
        the code or stream to send (B, T, k or d), or logits (B, T, V) at the last stage."""
        x = self._stream(tokens, received)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        if self.head is not None:
            return self.head(self.ln_f(x))
        if self.code_down is not None:
            return self.code_down(self.code_ln(x))
        return x

    def _stream(self, tokens: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
        """The residual stream (B, T, d) this part starts from."""
        if received is None:
            return self.embed(tokens)
        if self.code_up is None:
            return received + self.embed(tokens) if self.stream_embed else received
        x = self.code_up(received)
        return x + self.embed(tokens) if self.embed is not None else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy; logits (B, T, V), targets (B, T) -> scalar, or (B,) sums with 'sum_rows'."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    return flat.sum(dim=1) if reduction == "sum_rows" else flat.mean()
