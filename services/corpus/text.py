"""Monolingual English documents from Debian packages: man pages, the Debian Reference, LibreOffice's help.

What a language model trains on here (services/gpt): each package gives documents (a man page, a
chapter, a help page) as plain text. Nothing is unpacked to disk: files are read out of the .debs
(services.corpus.packages.deb_files). Man pages are roff; we keep their text and drop the requests
and font escapes, which is rough (tables come out as runs of words) but is prose a model can learn.
"""
from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from services.corpus import lohelp
from services.corpus.packages import HELP_ENGLISH, deb_files

# Packages whose English documents we read, and what kind each file is. The gettext packages of the
# parallel corpus add their English man pages (coreutils, dpkg, apt, ...): more, and more varied,
# packages to hold out whole for validation.
MAN_PACKAGES = ("manpages", "manpages-dev", "coreutils", "dpkg", "apt", "inkscape", "gimp-data", "darktable")
REFERENCE = "debian-reference-en"
TEXT_PACKAGES = (*MAN_PACKAGES, REFERENCE, HELP_ENGLISH)
_ENGLISH_MAN = re.compile(r"usr/share/man/man\w+/[^/]+\.gz")  # not usr/share/man/<lang>/...
_REFERENCE_PAGE = re.compile(r"usr/share/debian-reference/.*\.en\.html")


@dataclass(frozen=True)
class Document:
    package: str
    name: str  # the file it came from, inside the package
    text: str  # paragraphs separated by blank lines


def documents(package: str, deb: Path) -> Iterator[Document]:
    """Every English document of one package (empty for a package that has none)."""
    if package == HELP_ENGLISH:
        help_pages = lohelp.read_help(deb_files(deb, lambda p: lohelp.is_help_page(p, "en-US")), "en-US")
        for page, paragraphs in sorted(help_pages.items()):
            yield Document(package, page, "\n\n".join(paragraphs.values()))
        return
    wanted = _REFERENCE_PAGE.fullmatch if package == REFERENCE else _ENGLISH_MAN.fullmatch
    for path, data in deb_files(deb, lambda p: wanted(p) is not None):
        text = html_text(data.decode("utf-8", "replace")) if package == REFERENCE else man_text(data)
        if text.strip():
            yield Document(package, path, text)


# --- man pages (roff) ----------------------------------------------------------------------------------
_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")  # \fB, \f(CW, \f[I]
_SPECIAL = {r"\-": "-", r"\(em": "--", r"\(en": "-", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"', r"\(rq": '"',
            r"\(oq": "'", r"\(cq": "'", r"\(bu": "*", r"\(co": "(c)", r"\e": "\\", r"\ ": " ", r"\&": "", r"\|": "",
            r"\^": "", r"\:": "", r"\%": "", r"\~": " ", r"\c": ""}
_ESCAPE = re.compile(r"\\(\*\(..|\*\[[^\]]*\]|\*.|\(..|\[[^\]]*\]|s[-+]?\d+|[kvhwnoz]'[^']*'|.)")
_TEXT_MACROS = re.compile(r"^\.(SH|SS|B|I|BI|BR|IB|IR|RB|RI|SM|SB|TP|IP|Nm|Nd|Sh|Ss|It|Dl|Ql)\b\s*(.*)$")


def man_text(data: bytes) -> str:
    """The text of a gzipped man page; '' for a page that only points at another (`.so`)."""
    try:
        source = gzip.decompress(data).decode("utf-8", "replace")
    except (OSError, EOFError):
        return ""
    if source.lstrip().startswith(".so "):
        return ""
    paragraphs, current = [], []
    for line in source.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')):  # a comment
            continue
        macro = _TEXT_MACROS.match(line)
        if line.startswith((".", "'")) and not macro:  # a request (.PP, .TH, .de, ...) ends a paragraph
            if line[1:3] in ("PP", "LP", "P ", "SH", "sp", "TP", "IP", "P"):
                paragraphs.append(" ".join(current))
                current = []
            continue
        text = macro.group(2).replace('"', "") if macro else line
        text = _ESCAPE.sub(lambda m: _SPECIAL.get(m.group(0), ""), _FONT.sub("", text)).strip()
        if text:
            current.append(text)
    paragraphs.append(" ".join(current))
    return "\n\n".join(p for p in paragraphs if len(p.split()) >= 3)


# --- HTML (the Debian Reference) ----------------------------------------------------------------------
class _Text(HTMLParser):
    """Text of block elements (p, li, headings, pre, td), one paragraph each; scripts and styles dropped."""

    BLOCKS = {"p", "li", "h1", "h2", "h3", "h4", "pre", "td", "dt", "dd", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self._flush()

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self._parts.append(data)

    def _flush(self) -> None:
        text = " ".join("".join(self._parts).split())
        if text:
            self.paragraphs.append(text)
        self._parts = []


def html_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    parser._flush()
    return "\n\n".join(parser.paragraphs)
