"""The on-disk parallel corpus format, and reading one side of it.

A split is three line-aligned UTF-8 files sharing a prefix: `<prefix>.src`, `<prefix>.tgt` and `<prefix>.ids`
(e.g. data/es-en/train.src). Line i of each is example i; the id names the example on every site. Site a
reads only .src, site b only .tgt, each with the .ids, and `check_aligned` proves they hold the same examples
in the same order before training pairs them up. Lines are split on "\n" only: Unicode line separators
(U+2028, ...) may legitimately occur inside a sentence of a user's corpus.
"""
from __future__ import annotations

from pathlib import Path

from nebula.errors import ConfigError, DataError
from services.corpus.pair import Pair

SIDES = ("src", "tgt")


def write_split(prefix: Path, pairs: list[Pair]) -> None:
    """Write `<prefix>.{src,tgt,ids}`; text must already be one line per sentence."""
    ids = [p.id for p in pairs]
    if len(set(ids)) != len(ids):
        raise DataError(f"duplicate example ids in {prefix}: remove exact duplicate pairs before writing")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix, lines in (("src", [p.src for p in pairs]), ("tgt", [p.tgt for p in pairs]), ("ids", ids)):
        bad = next((line for line in lines if "\n" in line or "\r" in line), None)
        if bad is not None:
            raise DataError(f"a {suffix} line for {prefix} contains a line break: {bad!r}; clean it first")
        _write_lines(prefix.with_name(f"{prefix.name}.{suffix}"), lines)


def _write_lines(path: Path, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)


def read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"corpus file {path} not found: run `nebula data prepare`, or see docs/data.md for the format")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 ({exc}): convert it, e.g. with iconv -t UTF-8") from exc
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    return [line.removesuffix("\r") for line in lines]


class ParallelSide:
    """One side (src or tgt) of one split, with the example ids: all that one site may read.

    >>> side = ParallelSide("data/es-en/train", "src")   # reads train.src and train.ids
    >>> side[0], side.ids[0]
    """

    def __init__(self, prefix: str | Path, side: str):
        if side not in SIDES:
            raise ConfigError(f"side must be one of {SIDES}, got {side!r}")
        self.prefix = Path(prefix)
        self.side = side
        self.path = self.prefix.with_name(f"{self.prefix.name}.{side}")
        ids_path = self.prefix.with_name(f"{self.prefix.name}.ids")
        self.lines = read_lines(self.path)
        if not ids_path.is_file():
            raise DataError(
                f"{ids_path} not found: each split needs a line-aligned id file; for a corpus without ids "
                f"create one from line numbers, e.g. awk '{{print \"mycorpus:\" NR}}' {self.path} > {ids_path}"
            )
        self.ids = read_lines(ids_path)
        if len(self.lines) != len(self.ids):
            raise DataError(
                f"{self.path} has {len(self.lines)} lines but {ids_path} has {len(self.ids)}: the files must be "
                "line-aligned; regenerate them together"
            )
        if len(set(self.ids)) != len(self.ids):
            raise DataError(f"{ids_path} repeats an id: every example needs its own id")

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> str:
        return self.lines[index]

    def __iter__(self):
        return iter(zip(self.ids, self.lines))


def check_aligned(a: ParallelSide | list[str], b: ParallelSide | list[str]) -> None:
    """Raise DataError unless both sides list the same ids in the same order.

    Either argument may be a ParallelSide or just its id list (what a remote site sends, rather than its text).
    """
    ids_a = a.ids if isinstance(a, ParallelSide) else list(a)
    ids_b = b.ids if isinstance(b, ParallelSide) else list(b)
    if len(ids_a) != len(ids_b):
        raise DataError(
            f"sides differ in length ({len(ids_a)} vs {len(ids_b)} examples): both sites must use the same "
            "prepared split; re-copy the files from one `nebula data prepare` run"
        )
    for line, (x, y) in enumerate(zip(ids_a, ids_b), start=1):
        if x != y:
            raise DataError(
                f"sides disagree at line {line}: id {x!r} vs {y!r}; both sites must use the same prepared split"
            )
