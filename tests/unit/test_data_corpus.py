"""The on-disk format: each site reads one side plus ids; misalignment raises DataError."""
import pytest

from nebula.errors import ConfigError, DataError
from services.corpus import ParallelSide, check_aligned
from services.corpus.corpus import write_split
from services.corpus.pair import Pair

PAIRS = [
    Pair("vlc-l10n", "网络协议", "Network Protocol"),
    Pair("libreoffice-l10n-zh-cn", "框架内容", "Frame Contents"),
    # U+2028 inside a sentence must not split the line
    Pair("inkscape", "粘贴\u2028路径效果", "Paste Path Effect"),
]


def test_each_side_reads_its_text_and_the_shared_ids(tmp_path):
    write_split(tmp_path / "train", PAIRS)
    src = ParallelSide(tmp_path / "train", "src")
    tgt = ParallelSide(tmp_path / "train", "tgt")
    assert list(src.lines) == [p.src for p in PAIRS]
    assert tgt[1] == "Frame Contents" and len(tgt) == 3
    assert src.ids == [p.id for p in PAIRS] and src.ids[0].startswith("vlc-l10n:")
    check_aligned(src, tgt)
    check_aligned(src, tgt.ids)  # a remote site may send only its ids


def test_ids_are_stable():
    assert Pair("git", "a", "b").id == Pair("git", "a", "b").id != Pair("git", "a", "c").id


def test_mismatched_sides_raise(tmp_path):
    write_split(tmp_path / "a" / "train", PAIRS)
    write_split(tmp_path / "b" / "train", PAIRS[::-1])
    write_split(tmp_path / "c" / "train", PAIRS[:2])
    src = ParallelSide(tmp_path / "a" / "train", "src")
    with pytest.raises(DataError, match="disagree at line 1"):
        check_aligned(src, ParallelSide(tmp_path / "b" / "train", "tgt"))
    with pytest.raises(DataError, match="differ in length"):
        check_aligned(src, ParallelSide(tmp_path / "c" / "train", "tgt"))


def test_broken_files_raise(tmp_path):
    write_split(tmp_path / "train", PAIRS)
    (tmp_path / "train.tgt").write_text("only one line\n", encoding="utf-8")
    with pytest.raises(DataError, match="line-aligned"):
        ParallelSide(tmp_path / "train", "tgt")
    (tmp_path / "train.ids").unlink()
    with pytest.raises(DataError, match="awk"):
        ParallelSide(tmp_path / "train", "src")
    with pytest.raises(DataError, match="not found"):
        ParallelSide(tmp_path / "valid", "src")
    with pytest.raises(ConfigError):
        ParallelSide(tmp_path / "train", "en")


def test_writer_refuses_line_breaks_and_duplicate_ids(tmp_path):
    with pytest.raises(DataError, match="line break"):
        write_split(tmp_path / "x", [Pair("p", "a\nb", "c")])
    with pytest.raises(DataError, match="duplicate"):
        write_split(tmp_path / "y", [Pair("p", "a", "b"), Pair("p", "a", "b")])
