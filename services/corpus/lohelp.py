"""Translation pairs from LibreOffice's help: HTML pages per language whose paragraphs share ids.

Debian's libreoffice-help-<lang> packages ship the help compiled to HTML under
usr/share/libreoffice/help/<lang>/text/**.html. Each page exists in every language at the same relative path,
and each translatable paragraph or heading keeps its source id (`<p id="par_id3146957">`,
`<h1 id="hd_id3147291">`), so (page, id) aligns English with its translation exactly. Of the hidden
per-platform variants of a phrase (macOS "Option" vs "Alt"), only the default one is kept, on both sides.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Iterable, Iterator

_PARAGRAPH_ID = re.compile(r"(par|hd|tit)_id\w+")
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
_SPACE = re.compile(r"\s+")


class _Paragraphs(HTMLParser):
    """Collects the text of elements with a paragraph id; ids seen twice on a page are marked ambiguous."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: dict[str, str] = {}
        self.ambiguous: set[str] = set()
        self._stack: list[tuple[str, bool]] = []  # (tag, hidden) for each open element
        self._current: tuple[str, int, list[str]] | None = None  # (id, stack depth, text parts)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID:
            return
        attrs_d = dict(attrs)
        ident = attrs_d.get("id") or ""
        # Platform variants (macOS "Option" vs "Alt") are all hidden until the page's script shows one;
        # keep the default variant, as a reader on Linux or Windows sees it.
        self._stack.append((tag, "hidden" in attrs_d and not ident.startswith("default")))
        if self._current is None and _PARAGRAPH_ID.fullmatch(ident):
            self._current = (ident, len(self._stack), [])

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID or not any(t == tag for t, _ in self._stack):
            return  # a stray end tag: HTML pages are not always balanced
        while self._stack:
            open_tag, _ = self._stack.pop()
            self._close_paragraph_if_done()
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._current is not None and not any(hidden for _, hidden in self._stack):
            self._current[2].append(data)

    def _close_paragraph_if_done(self) -> None:
        if self._current is None or len(self._stack) >= self._current[1]:
            return
        ident, _, parts = self._current
        self._current = None
        if ident in self.texts:
            self.ambiguous.add(ident)
        self.texts[ident] = _SPACE.sub(" ", "".join(parts)).strip()


def paragraphs(html: str) -> dict[str, str]:
    """Paragraph id -> text for one help page; ids that occur twice on the page are left out."""
    parser = _Paragraphs()
    parser.feed(html)
    parser.close()
    return {k: v for k, v in parser.texts.items() if k not in parser.ambiguous and v}


HELP_ROOT = "usr/share/libreoffice/help/{lang_dir}/"


def is_help_page(path: str, lang_dir: str) -> bool:
    """Whether a packaged file is a help page for `lang_dir` (en-US, es, zh-CN); index pages are not."""
    return path.startswith(HELP_ROOT.format(lang_dir=lang_dir) + "text/") and path.endswith(".html")


def read_help(files: Iterable[tuple[str, bytes]], lang_dir: str) -> dict[str, dict[str, str]]:
    """Page path relative to the language's help root -> (paragraph id -> text), from (path, html) files."""
    root = HELP_ROOT.format(lang_dir=lang_dir)
    return {path.removeprefix(root): paragraphs(html.decode("utf-8", errors="replace")) for path, html in files}


def align(english: dict[str, dict[str, str]], foreign: dict[str, dict[str, str]]) -> Iterator[tuple[str, str]]:
    """(english, translation) for every paragraph id found on the same page in both languages, in page order."""
    for page in sorted(english.keys() & foreign.keys()):
        theirs = foreign[page]
        for ident, text in english[page].items():
            if ident in theirs:
                yield text, theirs[ident]
