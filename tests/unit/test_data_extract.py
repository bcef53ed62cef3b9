"""Extraction from real-format inputs: gettext catalogs built with polib from real strings, tiny .deb files
built with dpkg-deb, and LibreOffice help pages, run through the whole `prepare` pipeline offline."""
import json
import shutil
import subprocess

import polib
import pytest

from services.corpus import ParallelSide, check_aligned, lohelp, packages
from services.corpus.clean import Filter
from services.corpus.prepare import PrepareConfig, prepare, read_catalogs

# Real entries (msgctxt, msgid, msgstr) from Debian 12's es catalogs; "Remove" recurs across packages.
GIMP = [
    ("filters-action", "Color to _Alpha...", "Color a _alfa…"),
    (None, "Aspect Ratio", "Proporción de aspecto"),
    (None, "_Threshold...", "_Umbral…"),
    ("transform-handle-mode", "Remove", "Eliminar"),
]
GCC = [
    (None, "Use the DEC assembler syntax.", "Usa la sintaxis de ensamblador DEC."),
    (None, "Specify the target RX cpu type.", "Selecciona el tipo de cpu RX destino."),
    (None, "cannot declare %<::main%> to be static", "no se puede declarar %<::main%> como static"),
    (None, "Change the maximum length of conditionally-executed sequences.",
     "Cambia la longitud máxima de las secuencias ejecutadas condicionalmente."),
]
ISO = [
    (None, "Siwu", "Siwu"),  # untranslated: dropped
    (None, "Arabic, Tajiki", "Árabe, Tayiko"),
    (None, "Creole French, Saint Lucian", "Francés criollo, Saint Lucian"),
    (None, "Remove", "Eliminar"),
]
VLC = [(None, "&About", "&Acerca de"), (None, "Network Protocol", "Protocolo de red")]

# Real paragraphs of text/shared/optionen/01020000.html and text/sdraw/04/01020000.html (LibreOffice 7.4).
HELP_EN = {
    "text/shared/optionen/01020000.html": """<h1 id="hd_id3147291" dir="auto">Load/Save options</h1>
  <p id="par_id3146957" class="paragraph" dir="auto"><a name="laden"></a><span class="avis">Specifies general
  Load/Save settings. </span></p><p id="par_id1" class="paragraph">Only in English</p>""",
    "text/sdraw/04/01020000.html": """<p id="hd_id3147252" class="tablecontentintable" dir="auto"><span
  id="swlnsystextsdraw0401020000xml_23" class="switchinline"><span hidden="true" id="MACtextsdraw0401020000xml_23"
  class="MAC">Option</span><span hidden="true" id="defaulttextsdraw0401020000xml_23">Alt</span></span>+Shift+click
  an object</p>""",
}
HELP_ES = {
    "text/shared/optionen/01020000.html": """<h1 id="hd_id3147291" dir="auto">Opciones de carga y guardado</h1>
  <p id="par_id3146957" class="paragraph" dir="auto"><a name="laden"></a><span class="avis">Especifica la
  configuración general de carga y guardado.</span></p>""",
    "text/sdraw/04/01020000.html": """<p id="hd_id3147252" class="tablecontentintable" dir="auto"><span
  id="swlnsystextsdraw0401020000xml_23" class="switchinline"><span hidden="true" id="MACtextsdraw0401020000xml_23"
  class="MAC">⌥</span><span hidden="true" id="defaulttextsdraw0401020000xml_23">Alt</span></span> + Mayús +
  pulsar en un objeto</p>""",
}

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def write_mo(path, entries) -> None:
    catalog = polib.POFile()
    catalog.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Language": "es"}
    for ctxt, msgid, msgstr in entries:
        catalog.append(polib.POEntry(msgctxt=ctxt, msgid=msgid, msgstr=msgstr))
    path.parent.mkdir(parents=True, exist_ok=True)
    catalog.save_as_mofile(str(path))


def build_deb(cache, name, files: dict) -> None:
    """A minimal real .deb: `files` maps an installed path to bytes, a list of entries for a .mo, or a str:
    the target of a symlink."""
    root = cache / f"{name}-root"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: 1.0-1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: t\n"
    )
    for path, content in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            write_mo(target, content)
        elif isinstance(content, str):
            target.symlink_to(content)
        else:
            target.write_bytes(content)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                    str(cache / f"{name}_1.0-1_all.deb")], check=True, capture_output=True)
    shutil.rmtree(root)


def test_help_paragraphs_align_by_page_and_id():
    en = lohelp.read_help([(f"usr/share/libreoffice/help/en-US/{p}", h.encode()) for p, h in HELP_EN.items()], "en-US")
    es = lohelp.read_help([(f"usr/share/libreoffice/help/es/{p}", h.encode()) for p, h in HELP_ES.items()], "es")
    assert sorted(lohelp.align(en, es)) == [
        ("Alt+Shift+click an object", "Alt + Mayús + pulsar en un objeto"),  # the default (non-Mac) variant
        ("Load/Save options", "Opciones de carga y guardado"),
        ("Specifies general Load/Save settings.", "Especifica la configuración general de carga y guardado."),
    ]


def test_repeated_paragraph_ids_are_ambiguous_and_skipped():
    html = '<p id="par_id9">one</p><div><p id="par_id9">two</p></div><h2 id="hd_id1">Title <b>bold</b></h2>'
    assert lohelp.paragraphs(html) == {"hd_id1": "Title bold"}


@needs_dpkg
def test_catalogs_are_read_from_a_deb_without_symlinked_aliases(tmp_path):
    build_deb(tmp_path, "gimp-data", {"usr/share/locale/es/LC_MESSAGES/gimp20.mo": GIMP,
                                      "usr/share/locale/es/LC_MESSAGES/gimp-alias.mo": "gimp20.mo",
                                      "usr/share/locale/fr/LC_MESSAGES/gimp20.mo": GIMP})
    got = read_catalogs(tmp_path / "gimp-data_1.0-1_all.deb", packages.LANGUAGES["es"])
    # once each: the alias and the fr catalog are not read (a .mo file stores entries sorted by msgid)
    assert sorted(got) == sorted((msgid, msgstr) for _, msgid, msgstr in GIMP)


@needs_dpkg
def test_prepare_end_to_end_offline(tmp_path, monkeypatch):
    cache, out = tmp_path / "debs", tmp_path / "data"
    cache.mkdir()
    gettext = {"gimp-data": ("_", GIMP), "gcc-12-locales": ("", GCC), "iso-codes": ("", ISO), "vlc-l10n": ("&", VLC)}
    for name, (_, entries) in gettext.items():
        build_deb(cache, name, {f"usr/share/locale/es/LC_MESSAGES/{name}.mo": entries})
    build_deb(cache, "libreoffice-help-en-us",
              {f"usr/share/libreoffice/help/en-US/{p}": h.encode() for p, h in HELP_EN.items()})
    build_deb(cache, "libreoffice-help-es",
              {f"usr/share/libreoffice/help/es/{p}": h.encode() for p, h in HELP_ES.items()})
    monkeypatch.setattr(packages, "GETTEXT_PACKAGES", {name: m for name, (m, _) in gettext.items()})

    cfg = PrepareConfig(pairs=("es-en",), out=out, cache=cache, filter=Filter(max_len=64))
    manifest = prepare(cfg, log=lambda message: None)["es-en"]

    assert manifest == json.loads((out / "es-en/manifest.json").read_text())
    assert manifest["package_versions"]["gimp-data"] == "1.0-1"
    assert manifest["dropped"]["untranslated"] == 1  # Siwu
    splits = {name: (ParallelSide(out / "es-en" / name, "src"), ParallelSide(out / "es-en" / name, "tgt"))
              for name in ("train", "valid", "test")}
    for name, (src, tgt) in splits.items():
        check_aligned(src, tgt)
        assert len(src) == manifest["splits"][name] > 0
    written = [pair for src, tgt in splits.values() for pair in zip(src.lines, tgt.lines)]
    assert sorted(written) == sorted(EXPECTED)  # each cleaned pair once, "Eliminar/Remove" included
    test_text = set(splits["test"][0].lines)
    assert not test_text & set(splits["train"][0].lines)


# What the catalogs and help pages above become: accelerators, gcc's quote markers and markup gone.
EXPECTED = [
    ("Color a alfa…", "Color to Alpha..."),
    ("Proporción de aspecto", "Aspect Ratio"),
    ("Umbral…", "Threshold..."),
    ("Eliminar", "Remove"),
    ("Usa la sintaxis de ensamblador DEC.", "Use the DEC assembler syntax."),
    ("Selecciona el tipo de cpu RX destino.", "Specify the target RX cpu type."),
    ("no se puede declarar ::main como static", "cannot declare ::main to be static"),
    ("Cambia la longitud máxima de las secuencias ejecutadas condicionalmente.",
     "Change the maximum length of conditionally-executed sequences."),
    ("Árabe, Tayiko", "Arabic, Tajiki"),
    ("Francés criollo, Saint Lucian", "Creole French, Saint Lucian"),
    ("Acerca de", "About"),
    ("Protocolo de red", "Network Protocol"),
    ("Opciones de carga y guardado", "Load/Save options"),
    ("Especifica la configuración general de carga y guardado.", "Specifies general Load/Save settings."),
    ("Alt + Mayús + pulsar en un objeto", "Alt+Shift+click an object"),
]
