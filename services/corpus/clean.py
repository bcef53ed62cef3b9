"""Cleaning rules for software-localisation text: strip what is markup rather than language, then filter.

Catalog strings carry printf/format placeholders, markup tags, GUI accelerators and line breaks that a
translation model should not learn to copy; both sides of a pair carry them alike, so stripping them keeps the
pair parallel. The filters then drop pairs that teach nothing (empty, untranslated, wrong script) or that fall
outside the configured length in `units`: whitespace-separated words, with each CJK character its own unit.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

from nebula.errors import ConfigError

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_UNIT = re.compile(rf"[{_HAN}]|[^\s{_HAN}]+")
_HAS_HAN = re.compile(rf"[{_HAN}]")

# LibreOffice substitutes these at run time; the help pages already show the substituted product name.
_PRODUCT_VARS = {"PRODUCTNAME": "LibreOffice", "PRODUCTVERSION": "", "OOO": "LibreOffice"}

_PLACEHOLDER = re.compile(
    r"%<PRI\w+>"  # gettext's system-dependent segments, e.g. %<PRIu64>
    r"|%[<>]"  # gcc's quote markers around code: %<::main%>
    r"|%%"  # a literal percent sign (kept as one '%')
    r"|%(?P<var>[A-Z][A-Z0-9_]{2,})"  # LibreOffice variables: %PRODUCTNAME
    r"|%(?:\(\w+\))?(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?"
    r"(?:hh|h|ll|l|L|q|j|z|t|w|I64|I32)?[a-zA-Z]"  # printf: %s %d %1$s %-10lu %qE %(name)s
    r"|%\d+(?![\w$])"  # positional Qt/LibreOffice arguments: %1
    r"|\$\{\w+\}|\$\(\w+\)|\$\w+\$"  # ${var}, $(ARG1), $ARG1$
    r"|%?\{[\w.:-]*\}"  # format fields: {name}, {0}, {0:d}, LibreOffice's %{link}
    r"|</?[^\W\d_][\w:-]*(?:\s[^<>]*)?/?>"  # markup tags and metavariables: <b>, <br/>, <file>, <选项>
    r"|~[asAS%](?![^\W\d_])"  # Lisp/Scheme format directives (Audacity's Nyquist, GnuCash): ~a ~A ~%
    r"|\\[nt]"  # escaped line breaks left literally in some catalogs
)

# Accelerators (mnemonics). Chinese catalogs append them in brackets: "文件(_F)", "添加（&A）".
_BRACKET_MNEMONIC = re.compile(r"\s*[(（][_&~][A-Za-z0-9][)）]")
_TILDE_MNEMONIC = re.compile(r"~(?=[^\W_])")
_AMP_MNEMONIC = re.compile(r"&(?=[^\W_])(?!#?\w+;)")
_UNDERSCORE_MNEMONIC = re.compile(r"_(?=[^\W_])")

_EMPTY_ENCLOSURE = re.compile(r""""\s*"|'\s*'|“\s*”|‘\s*’|«\s*»|「\s*」|『\s*』|\(\s*\)|（\s*）|\[\s*\]""")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?，。；：！？、)）])(?=\s|$)")
_REPEATED_SEPARATOR = re.compile(r"([,;:，；：、])(?:\s*[,;，；、])+")  # "vars: {a}, {b}" left "vars:, ,"
_SPACE = re.compile(r"\s+")


def _placeholder(match: re.Match) -> str:
    if match.group(0) == "%%":
        return "%"
    var = match.group("var")
    if var is not None:
        return _PRODUCT_VARS.get(var, "")
    return " " if match.group(0) in ("\\n", "\\t") else ""


def strip_placeholders(text: str) -> str:
    return _PLACEHOLDER.sub(_placeholder, text)


def strip_accelerators(text: str, markers: str) -> str:
    """Remove GUI accelerator markers: _File (GTK), &File (Qt, wxWidgets), ~File (LibreOffice), 文件(_F).

    `markers` names the ones the catalog's toolkit uses: elsewhere the same characters are literal text
    ("Date&Time" in LibreOffice). In Qt, `&&` is a literal ampersand.
    """
    text = _BRACKET_MNEMONIC.sub("", text)
    if "~" in markers:
        text = _TILDE_MNEMONIC.sub("", text)
    if "&" in markers:
        text = _AMP_MNEMONIC.sub("", text.replace("&&", "\0")).replace("\0", "&")
    # More than one underscore means identifiers (max_wal_size), not a mnemonic.
    if "_" in markers and text.count("_") == 1:
        text = _UNDERSCORE_MNEMONIC.sub("", text)
    return text


def tidy(text: str) -> str:
    """Collapse whitespace (line breaks included) and remove what stripping left behind: '()', ' :'."""
    text = _SPACE.sub(" ", text)
    text = _EMPTY_ENCLOSURE.sub("", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _REPEATED_SEPARATOR.sub(r"\1", text)
    text = _SPACE.sub(" ", text).strip()
    return text.lstrip(",;:，；：、 ").rstrip(",;，；、 ")


def clean_text(text: str, *, accelerators: str = "") -> str:
    """One catalog or help string -> plain sentence text on one line; `accelerators` as in strip_accelerators."""
    text = strip_placeholders(text)
    if accelerators:
        text = strip_accelerators(text, accelerators)
    # Entities last, so that an escaped "&amp;" is never taken for an accelerator; &nbsp; becomes a space.
    return tidy(html.unescape(text))


def units(text: str) -> int:
    """Length in words, counting each CJK character as a word (Chinese has no spaces)."""
    return len(_UNIT.findall(text))


@dataclass(frozen=True, kw_only=True)
class Filter:
    """Which cleaned pairs to keep; lengths are in `units` and apply to both sides."""

    min_len: int = 1
    max_len: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ConfigError(
                f"length limits min_len={self.min_len}, max_len={self.max_len} are invalid: "
                "use 1 <= min_len <= max_len (e.g. --min-len 1 --max-len 64)"
            )

    def reject(self, src: str, tgt: str, *, src_lang: str) -> str | None:
        """The reason to drop a cleaned pair (a short key for the manifest), or None to keep it."""
        if not src or not tgt:
            return "empty"
        if src.casefold() == tgt.casefold():
            return "untranslated"
        if not any(c.isalpha() for c in src) or not any(c.isalpha() for c in tgt):
            return "no_letters"
        if src_lang == "zh" and not _HAS_HAN.search(src):
            return "wrong_script"
        longest = max(units(src), units(tgt))
        if longest > self.max_len:
            return "too_long"
        if min(units(src), units(tgt)) < self.min_len:
            return "too_short"
        return None
