"""The README stays what a newcomer reads (issue 56): at most 1,500 words, no line over 300 characters (a
measurement paragraph inside a table cell belongs in docs/)."""
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_is_short_and_its_lines_fit_a_screen():
    text = README.read_text()
    assert len(text.split()) <= 1500
    long = [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > 300]
    assert not long, f"lines over 300 characters (line, length): {long}"
