"""Cleaning rules, on real msgid/msgstr strings from Debian 12 packages (quoted with their package)."""
import pytest

from nebula.errors import ConfigError
from services.corpus.clean import Filter, clean_text, units


@pytest.mark.parametrize(
    "raw, accelerators, expected",
    [
        # gimp-data (GTK): underscore mnemonic, Spanish and English alike
        ("Color to _Alpha...", "_", "Color to Alpha..."),
        ("Color a _alfa…", "_", "Color a alfa…"),
        # libreoffice-l10n-zh-cn: the Chinese catalog appends the mnemonic in brackets
        ("添加(_A)...", "_~", "添加..."),
        ("所有页面(~P)", "_~", "所有页面"),
        ("All ~Pages", "_~", "All Pages"),
        # ...but in LibreOffice "&" is a plain ampersand
        ("Date&Time", "_~", "Date&Time"),
        # vlc-l10n (Qt): "&" mnemonics, also bracketed in Chinese
        ("&About", "&", "About"),
        ("关于(&A)", "&", "关于"),
        # postgresql-15: no accelerators, so identifiers keep their underscores
        ("max_wal_size must be at least twice wal_segment_size", "",
         "max_wal_size must be at least twice wal_segment_size"),
    ],
)
def test_accelerators_are_stripped_per_toolkit(raw, accelerators, expected):
    assert clean_text(raw, accelerators=accelerators) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        # gcc-12-locales: %qE, %d and the %< %> quote markers
        ("passing argument %d of %qE from pointer to non-enclosed address space",
         "passing argument of from pointer to non-enclosed address space"),
        ("cannot declare %<::main%> to be static", "cannot declare ::main to be static"),
        ("no se puede declarar %<::main%> como static", "no se puede declarar ::main como static"),
        # postgresql-15: quoted %s leaves no empty quotes behind; %m is glibc's strerror
        ('template database "%s" does not exist', "template database does not exist"),
        ('模板数据库 "%s" 不存在', "模板数据库 不存在"),
        # inkscape: positional printf arguments inside markup
        ("<b>%1$i</b> objects selected of type %2$s", "objects selected of type"),
        ("已选择类型 %2$s 的 <b>%1$i</b> 个对象", "已选择类型 的 个对象"),
        # inkscape: str.format fields; libreoffice: %{link}
        ("Label text format, available variables: {measure}, {unit}", "Label text format, available variables:"),
        ("Click to open hyperlink: %{link}", "Click to open hyperlink:"),
        # coreutils: ${VAR}
        ("only ${VARNAME} expansion is supported, error at: %s", "only expansion is supported, error at:"),
        # libreoffice-l10n-es: line breaks become spaces
        ("You will have to restart the program after this edit.\nContinue?",
         "You will have to restart the program after this edit. Continue?"),
        # libreoffice: the product name variable is substituted, not dropped
        ("Welcome to %PRODUCTNAME", "Welcome to LibreOffice"),
        # audacity-data: HTML entities and Nyquist ~a directives
        ("DC Offset: &nbsp;&nbsp;~a", "DC Offset:"),
        # a literal percent survives, both escaped and bare
        ("Change lower speed limit (%%) to:", "Change lower speed limit (%) to:"),
        ("50% de descuento", "50% de descuento"),
    ],
)
def test_placeholders_and_markup_are_stripped(raw, expected):
    assert clean_text(raw) == expected


def test_units_count_words_and_each_chinese_character():
    assert units("Network Protocol") == 2
    assert units("网络协议") == 4
    assert units("Podcast 链接") == 3


@pytest.mark.parametrize(
    "src, tgt, lang, reason",
    [
        ("Siwu", "Siwu", "es", "untranslated"),  # iso-codes: a name left as is
        ("", "Open", "es", "empty"),
        ("...", "...", "es", "untranslated"),
        ("—", "…", "es", "no_letters"),
        ("Description", "Description ", "zh", "wrong_script"),  # libreoffice-help-zh-cn: untranslated page text
        ("网络协议", "Network Protocol", "zh", None),  # vlc-l10n
        ("Abrir " * 65, "Open " * 65, "es", "too_long"),
    ],
)
def test_filter_reasons(src, tgt, lang, reason):
    assert Filter().reject(src.strip(), tgt, src_lang=lang) == reason


def test_filter_min_len_applies_to_both_sides():
    flt = Filter(min_len=2)
    assert flt.reject("文件", "File", src_lang="zh") == "too_short"  # 2 units vs 1
    assert flt.reject("网络协议", "Network Protocol", src_lang="zh") is None


def test_filter_rejects_bad_limits():
    with pytest.raises(ConfigError, match="min_len"):
        Filter(min_len=10, max_len=5)
