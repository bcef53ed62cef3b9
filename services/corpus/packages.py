"""Which Debian packages give parallel text, and fetching them offline-friendly with apt-get / dpkg-deb.

Every package here ships English source strings with their Spanish and Chinese translations: gettext catalogs
(.mo) for the programs, and LibreOffice's help as HTML pages in each language. `apt-get download` needs no root
and installs nothing; downloaded .deb files stay in a cache directory and are reused on the next run. Files are
read straight out of each .deb's data archive, never unpacked to disk.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from nebula.errors import ConfigError, DataError


@dataclass(frozen=True)
class Language:
    code: str  # the pair's language code: "es" in "es-en"
    deb: str  # suffix of LibreOffice's per-language packages: libreoffice-l10n-zh-cn
    locale_dirs: tuple[str, ...]  # gettext catalog directories: .../<dir>/LC_MESSAGES/*.mo
    help_dir: str  # LibreOffice help directory: usr/share/libreoffice/help/<dir>/


LANGUAGES = {
    "es": Language("es", "es", ("es",), "es"),
    # zh_Hans is the script-tagged name some projects (iso-codes) use for Simplified Chinese.
    "zh": Language("zh", "zh-cn", ("zh_CN", "zh_Hans"), "zh-CN"),
}

# Gettext packages, each mapped to the accelerator markers its toolkit puts in strings: "_" for GTK
# (_File), "&" for Qt and wxWidgets (&File), "~" for LibreOffice (~File). Only GUI programs have them;
# elsewhere "_" is part of an identifier and "&" is an ampersand, and they must stay.
# "{deb}" is replaced by the language's LibreOffice package suffix. Verified on Debian 12 (bookworm).
GETTEXT_PACKAGES = {
    "apt": "",
    "audacity-data": "&",
    "coreutils": "",
    "darktable": "_",
    "dpkg": "",
    "evolution-common": "_",
    "evolution-data-server-common": "",
    "filezilla-common": "&",
    "gcc-12-locales": "",
    "geany-common": "_",
    "gedit-common": "_",
    "gimp-data": "_",
    "git": "",
    "gnome-control-center-data": "_",
    "gnucash-common": "_",
    "gnupg-l10n": "",
    "inkscape": "_",
    "iso-codes": "",
    "libc-l10n": "",
    "libglib2.0-data": "",
    "libgtk-3-common": "_",
    "libreoffice-l10n-{deb}": "_~",
    "nautilus-data": "_",
    "postgresql-15": "",
    "util-linux-locales": "",
    "vlc-l10n": "&",
}
HELP_PACKAGE = "libreoffice-help-{deb}"
HELP_ENGLISH = "libreoffice-help-en-us"


def language_of(pair: str) -> Language:
    """'es-en' -> the Spanish Language; only <lang>-en pairs with a known language are supported."""
    src, _, tgt = pair.partition("-")
    if tgt != "en" or src not in LANGUAGES:
        known = ", ".join(f"{code}-en" for code in LANGUAGES)
        raise ConfigError(f"unknown language pair {pair!r}: choose from {known}")
    return LANGUAGES[src]


def packages_for(lang: Language) -> dict[str, str]:
    """Gettext package name -> its accelerator markers, for one language."""
    return {name.format(deb=lang.deb): markers for name, markers in GETTEXT_PACKAGES.items()}


def all_packages(langs: list[Language]) -> list[str]:
    names = {HELP_ENGLISH}
    for lang in langs:
        names.update(packages_for(lang))
        names.add(HELP_PACKAGE.format(deb=lang.deb))
    return sorted(names)


def cached_deb(cache: Path, package: str) -> Path | None:
    """The cached .deb of a package (apt names them <package>_<version>_<arch>.deb), if present."""
    found = sorted(cache.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def download(packages: list[str], cache: Path, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Fetch the packages missing from `cache` with one `apt-get download`; return package -> .deb path."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if cached_deb(cache, p) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise DataError(
                f"apt-get not found, and {cache} lacks {', '.join(missing)}: run on Debian/Ubuntu, or copy "
                "those .deb files (from any Debian mirror) into the cache directory"
            )
        log(f"downloading {len(missing)} packages into {cache}: {' '.join(missing)}")
        done = subprocess.run(["apt-get", "download", *missing], cwd=cache, capture_output=True, text=True)
        if done.returncode != 0 and os.geteuid() == 0:
            # a fresh machine often has empty package lists: refresh them once (root only) and retry
            log("apt-get download failed; running `apt-get update` once and retrying")
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
            done = subprocess.run(["apt-get", "download", *missing], cwd=cache, capture_output=True, text=True)
        if done.returncode != 0:
            raise DataError(
                f"apt-get download failed for {' '.join(missing)}:\n{done.stderr.strip()}\n"
                "run `apt-get update` first, or copy the .deb files into the cache directory"
            )
    debs = {p: cached_deb(cache, p) for p in packages}
    absent = [p for p, deb in debs.items() if deb is None]
    if absent:
        raise DataError(f"apt-get reported success but {cache} has no .deb for {', '.join(absent)}")
    return debs


def deb_version(deb: Path) -> str:
    return _dpkg_deb(["-f", str(deb), "Version"]).strip()


def deb_files(deb: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(path, content) of each regular file in a .deb whose path (e.g. "usr/share/locale/es/...") `wanted`
    accepts. The data archive is streamed from `dpkg-deb --fsys-tarfile`: nothing is unpacked to disk, which
    here took longer than all the parsing. Symlinks and hard links are skipped: they alias files already read.
    """
    _require_dpkg_deb()
    # stderr goes to a file: a pipe nobody reads until the end could fill up and stall dpkg-deb.
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=errors)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                path = member.name.removeprefix("./")
                if member.isfile() and wanted(path):
                    yield path, tar.extractfile(member).read()
    except tarfile.TarError as exc:
        raise DataError(f"cannot read the files of {deb}: {exc}; delete it to re-download") from exc
    finally:
        proc.stdout.close()
        returncode = proc.wait()
        errors.seek(0)
        message = errors.read().decode(errors="replace").strip()
        errors.close()
    if returncode != 0:
        raise DataError(f"dpkg-deb --fsys-tarfile {deb} failed: {message}; delete the file to re-download")


def _require_dpkg_deb() -> None:
    if shutil.which("dpkg-deb") is None:
        raise DataError("dpkg-deb not found: install the `dpkg` package (it ships with every Debian system)")


def _dpkg_deb(args: list[str]) -> str:
    _require_dpkg_deb()
    done = subprocess.run(["dpkg-deb", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise DataError(f"dpkg-deb {' '.join(args)} failed: {done.stderr.strip()}; delete the file to re-download")
    return done.stdout
