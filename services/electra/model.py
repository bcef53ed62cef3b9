"""The two models of ELECTRA-Cloud (paper §3.1): a generator G and a discriminator D with their own
embeddings (not shared, so only token ids cross the WAN).

G is a small BERT with a masked-LM head; D a larger one with two heads: replaced-token detection
(one logit per token, Eq. 8) and corrective LM (the original token at each masked position, Eq. 10).
Both are the post-LN BERT of services.models.plm, so D can also start from multilingual-e5-small.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nebula.config import limits
from nebula.errors import ConfigError
from nebula.runtime.checkpoint import CheckpointDir
from services.models.plm import BertConfig, BertModel
from services.models.vocab import VocabMap, cut_embeddings
from services.models.xlmr_e5 import load_e5_small


@dataclass(frozen=True, kw_only=True)
class Size:
    """A BERT encoder's shape (job-file keys of a stage)."""

    hidden: int = field(default=256, metadata=limits(at_least=8))
    layers: int = field(default=4, metadata=limits(at_least=1, at_most=48))
    heads: int = field(default=4, metadata=limits(at_least=1))
    ffn: int = field(default=1024, metadata=limits(at_least=8))
    dropout: float = field(default=0.1, metadata=limits(at_least=0, below=1))

    def bert(self, vocab: int, max_len: int) -> BertConfig:
        return BertConfig(vocab_size=vocab, hidden_size=self.hidden, num_layers=self.layers, num_heads=self.heads,
                          intermediate_size=self.ffn, max_positions=max_len, dropout=self.dropout)


def bert_init(module: nn.Module) -> None:
    """BERT's initialisation (normal, std 0.02; LayerNorm 1 and 0): torch's default N(0, 1) embeddings
    would make the tied heads' first logits enormous."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class TiedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> logits over the vocabulary with the input embeddings (BERT's MLM head)."""

    def __init__(self, embeddings: nn.Embedding):
        super().__init__()
        hidden = embeddings.embedding_dim
        self.dense, self.norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden)
        self.embeddings = embeddings
        self.bias = nn.Parameter(torch.zeros(embeddings.num_embeddings))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h))) @ self.embeddings.weight.T + self.bias


class Generator(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = BertModel(config)
        self.lm = TiedLMHead(self.bert.embeddings.word_embeddings)
        bert_init(self)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Logits (M, V) at the positions `at` (B, S) bool."""
        return self.lm(self.bert(ids, mask)[at])


class Discriminator(nn.Module):
    def __init__(self, bert: BertModel, pretrained: bool = False):
        super().__init__()
        self.bert = bert
        hidden = bert.cfg.hidden_size
        self.rtd = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.clm = TiedLMHead(bert.embeddings.word_embeddings)
        bert_init(self.rtd)
        bert_init(self.clm.dense)
        if not pretrained:
            bert_init(self.bert)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (replaced-token logits (B, S), corrective-LM logits (M, V) at the positions `at`)."""
        h = self.bert(ids, mask)
        return self.rtd(h).squeeze(-1), self.clm(h[at])

    @torch.no_grad()
    def pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean of the last layer's states over the real tokens: (B, H), for the evaluations."""
        h = self.bert(ids, mask)
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


def e5_discriminator(vmap, max_len: int) -> BertModel:
    """multilingual-e5-small (12 x 384, XLM-R vocabulary) cut to the workload's vocabulary, trainable."""
    bert = load_e5_small().model
    rows = bert.embeddings.word_embeddings.num_embeddings
    if rows > vmap.old_size:  # e5's table is padded past the tokenizer's ids (250,037 rows for 250,002 ids)
        vmap = VocabMap(vmap.new_to_old, rows, vmap.unk_old)
    bert = cut_embeddings(bert, vmap)
    if max_len > bert.cfg.max_positions:
        raise ValueError(f"max_len {max_len} exceeds multilingual-e5-small's {bert.cfg.max_positions} positions")
    for p in bert.parameters():
        p.requires_grad_(True)
    return bert.set_dropout(0.1)


def load_trained(module: nn.Module, path: str, job_file: Path | None, key: str) -> None:
    """Copy the weights of a stage checkpoint (`<dir>/step-N.pt`, checksum verified) into `module`, which
    must have the same shape: G hot-started from the weights of an earlier run, not from its optimiser.
    `path` is relative to the job file, as [job].data is."""
    file = Path(path)
    if not file.is_absolute() and job_file is not None:
        file = Path(job_file).parent / file
    step = re.fullmatch(r"step-(\d{8})\.pt", file.name)
    if step is None or not file.is_file():
        raise ConfigError(f"{key} = {path!r}: expected a checkpoint file step-NNNNNNNN.pt of an earlier run's "
                          f"stage (e.g. runs/g-mlm/generator/checkpoints/step-00000300.pt); {file} "
                          f"{'is not one' if file.is_file() else 'does not exist'}")
    weights = CheckpointDir(file.parent).load(int(step.group(1)))["stage"]["weights"]
    names = {name for name, _ in module.named_parameters()}  # a tied weight once, as checkpoints keep it
    odd = sorted(names ^ set(weights))
    try:
        if odd:
            raise RuntimeError(f"names missing or unexpected: {odd[:5]}")
        module.load_state_dict(weights, strict=False)  # strict would ask for the tied head's alias too
    except RuntimeError as exc:  # other names or shapes
        raise ConfigError(f"{key} = {path!r}: its weights do not fit this stage's model (set the same size, "
                         f"max_len and vocabulary as the run that wrote it): {str(exc)[:400]}") from exc
