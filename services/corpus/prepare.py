"""`nebula data prepare`: Debian packages -> cleaned, package-held-out parallel corpora on disk.

Steps: download (cached) -> read files out of the .debs -> pairs from gettext catalogs and LibreOffice help ->
clean and filter -> drop exact duplicates -> split by package -> write <out>/<pair>/{split}.{src,tgt,ids}
and <out>/<pair>/manifest.json.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from services.corpus import catalogs, lohelp
from services.corpus.clean import Filter, clean_text
from services.corpus.corpus import write_split
from services.corpus.packages import (
    HELP_ENGLISH,
    HELP_PACKAGE,
    Language,
    all_packages,
    deb_files,
    deb_version,
    download,
    language_of,
    packages_for,
)
from services.corpus.pair import Pair
from services.corpus.split import Split, split_by_package

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    pairs: tuple[str, ...] = ("es-en", "zh-en")
    out: Path = Path("data")
    cache: Path = Path(".cache/debs")
    filter: Filter = field(default_factory=Filter)
    seed: int = 0
    valid_fraction: float = 0.05
    test_fraction: float = 0.05


def prepare(cfg: PrepareConfig, log: Log = print) -> dict[str, dict]:
    """Build every requested pair; returns pair -> its manifest (also written to disk)."""
    langs = [language_of(pair) for pair in cfg.pairs]
    debs = download(all_packages(langs), cfg.cache, log)
    versions = {package: deb_version(deb) for package, deb in debs.items()}
    log("reading the English LibreOffice help")
    english_help = read_help(debs[HELP_ENGLISH], "en-US")
    manifests = {}
    for pair, lang in zip(cfg.pairs, langs):
        pairs, stats = collect(lang, debs, english_help, cfg.filter, log=lambda m, p=pair: log(f"{p}  {m}"))
        split = split_by_package(
            pairs, seed=cfg.seed, valid_fraction=cfg.valid_fraction, test_fraction=cfg.test_fraction
        )
        manifests[pair] = write_corpus(cfg.out / pair, split, manifest_base(pair, cfg, versions, stats))
    return manifests


def ensure_prepared(pair_dir: Path, log: Log = print) -> None:
    """Prepare the pair `pair_dir` is named after (e.g. data/es-en) into its parent, unless it holds a
    training split already: what a demo does before its first run."""
    if (pair_dir / "train.src").exists():
        return
    log(f"preparing the {pair_dir.name} corpus from Debian translation packages (once) ...")
    prepare(PrepareConfig(pairs=(pair_dir.name,), out=pair_dir.parent), log)


def read_help(deb: Path, lang_dir: str) -> dict[str, dict[str, str]]:
    return lohelp.read_help(deb_files(deb, lambda path: lohelp.is_help_page(path, lang_dir)), lang_dir)


def read_catalogs(deb: Path, lang: Language) -> list[tuple[str, str]]:
    files = deb_files(deb, lambda path: catalogs.is_catalog(path, lang.locale_dirs))
    return [pair for path, data in sorted(files) for pair in catalogs.read_catalog(data, f"{deb.name}:{path}")]


def collect(
    lang: Language, debs: dict[str, Path], english_help: dict, flt: Filter, *, log: Log
) -> tuple[list[Pair], dict]:
    """Every cleaned pair for one language, in a fixed order, plus per-package and drop statistics."""
    pairs: list[Pair] = []
    dropped: Counter = Counter()
    extracted = {}
    for package, raw, markers in raw_pairs(lang, debs, english_help):
        kept = clean_pairs(package, raw, lang.code, accelerators=markers, flt=flt, dropped=dropped)
        extracted[package] = len(raw)
        log(f"{package:<28} {len(raw):>7} extracted {len(kept):>7} kept")
        pairs += kept
    unique = list(dict.fromkeys(pairs))
    dropped["duplicate"] += len(pairs) - len(unique)
    return unique, {"extracted": extracted, "dropped": dict(dropped), "before_split": len(unique)}


def raw_pairs(lang: Language, debs: dict[str, Path], english_help: dict) -> Iterator[tuple[str, list, str]]:
    """(package, [(english, translation)], accelerator markers) for each package, read one at a time."""
    for package, markers in packages_for(lang).items():
        yield package, read_catalogs(debs[package], lang), markers
    help_package = HELP_PACKAGE.format(deb=lang.deb)
    foreign_help = read_help(debs[help_package], lang.help_dir)
    yield help_package, list(lohelp.align(english_help, foreign_help)), ""


def clean_pairs(
    package: str, raw: list[tuple[str, str]], src_lang: str, *, accelerators: str, flt: Filter, dropped: Counter
) -> list[Pair]:
    """(english, translation) strings -> cleaned Pairs that pass the filter; counts drops by reason."""
    kept = []
    for english, foreign in raw:
        src = clean_text(foreign, accelerators=accelerators)
        tgt = clean_text(english, accelerators=accelerators)
        reason = flt.reject(src, tgt, src_lang=src_lang)
        if reason is None:
            kept.append(Pair(package, src, tgt))
        else:
            dropped[reason] += 1
    return kept


def manifest_base(pair: str, cfg: PrepareConfig, versions: dict[str, str], stats: dict) -> dict:
    return {
        "pair": pair,
        "source": "Debian packages (gettext catalogs and LibreOffice help)",
        "filter": asdict(cfg.filter),
        "seed": cfg.seed,
        "valid_fraction": cfg.valid_fraction,
        "test_fraction": cfg.test_fraction,
        "package_versions": {p: versions[p] for p in stats["extracted"]},
        "extracted": stats["extracted"],
        "dropped": stats["dropped"],
        # Splitting removes more: train/valid pairs sharing text with a held-out split, and repeated sources.
        "before_split": stats["before_split"],
    }


def write_corpus(pair_dir: Path, split: Split, manifest: dict) -> dict:
    """Write the three splits and manifest.json; returns the manifest."""
    per_package: dict[str, dict[str, int]] = {}
    for name, pairs in split.parts().items():
        write_split(pair_dir / name, pairs)
        for package, count in sorted(Counter(p.package for p in pairs).items()):
            per_package.setdefault(package, {})[name] = count
    manifest = {
        **manifest,
        "splits": {name: len(pairs) for name, pairs in split.parts().items()},
        "valid_packages": split.valid_packages,
        "test_packages": split.test_packages,
        "per_package": per_package,
    }
    (pair_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest
