"""Translation pairs from gettext catalogs: msgid (English) <-> msgstr, read with polib."""
from __future__ import annotations

from typing import Iterator

import polib

from nebula.errors import DataError


def is_catalog(path: str, locale_dirs: tuple[str, ...]) -> bool:
    """Whether a packaged file is a catalog for one of `locale_dirs`: any .../<dir>/LC_MESSAGES/*.mo or *.po,
    which covers usr/share/locale and LibreOffice's program/resource alike."""
    parts = path.split("/")
    return (
        len(parts) >= 3
        and parts[-2] == "LC_MESSAGES"
        and parts[-3] in locale_dirs
        and parts[-1].endswith((".mo", ".po"))
    )


def read_catalog(data: bytes, name: str) -> Iterator[tuple[str, str]]:
    """(english, translation) for every usable entry of one catalog's bytes: translated, not fuzzy, not obsolete.

    Plural entries give their singular forms (msgid with msgstr[0]): form 0 is the singular in Spanish, and
    the only form in Chinese. `name` (the catalog's path) is for error messages.
    """
    try:
        if name.endswith(".po"):
            catalog = polib.pofile(data.decode("utf-8"))
        else:
            catalog = polib.mofile(data)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read catalog {name}: {exc}; delete the cached .deb to re-download it") from exc
    for entry in catalog:
        if entry.obsolete or "fuzzy" in entry.flags or not entry.msgid:
            continue
        translation = entry.msgstr or entry.msgstr_plural.get(0, "")
        if translation:
            yield entry.msgid, translation
