"""`nebula --version`, `nebula --help`, and every option's default from its NEBULA_* variable (as torchrun
reads PET_*): the variable fills in what the command line leaves out, a flag given wins, a bad value is
argparse's usage error naming the variable, and only the command that runs reads its variables."""
import argparse
from importlib.metadata import version
from pathlib import Path

import pytest

from nebula.cli import Parser, build_parser, main


def toy() -> argparse.ArgumentParser:
    """One of each kind of option, under a sub-command, as the commands use them."""
    parser = Parser(prog="toy")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--work-dir", type=Path, required=True)
    run.add_argument("--steps", type=int, default=5)
    run.add_argument("--schedule", choices=["synchronous", "one-step-stale"], default="synchronous")
    run.add_argument("--quiet", action="store_true")
    run.add_argument("--color", action=argparse.BooleanOptionalAction, default=True)
    run.add_argument("--verbose", "-v", action="count", default=0)
    run.add_argument("--codec", action="append")
    run.add_argument("--setting", nargs=2, action="append")
    run.add_argument("--pairs", nargs="+")
    other = sub.add_parser("other")
    other.add_argument("--name", default="x")
    return parser


def test_variables_fill_in_every_kind_of_option(monkeypatch):
    for name, value in {"WORK_DIR": "runs/x", "STEPS": "40", "SCHEDULE": "one-step-stale", "QUIET": "yes",
                        "COLOR": "off", "VERBOSE": "2", "CODEC": "fp16 'int8 (block 64)'",
                        "SETTING": "fp16 int8 none none", "PAIRS": "es-en zh-en"}.items():
        monkeypatch.setenv(f"NEBULA_{name}", value)
    args = toy().parse_args(["run"])  # --work-dir is required: its variable is enough
    assert (args.work_dir, args.steps, args.schedule, args.quiet, args.color, args.verbose) == \
        (Path("runs/x"), 40, "one-step-stale", True, False, 2)
    assert args.codec == ["fp16", "int8 (block 64)"]
    assert args.setting == [["fp16", "int8"], ["none", "none"]]
    assert args.pairs == ["es-en", "zh-en"]


def test_an_option_given_wins_over_its_variable(monkeypatch):
    monkeypatch.setenv("NEBULA_STEPS", "40")
    monkeypatch.setenv("NEBULA_CODEC", "fp16 int8")
    monkeypatch.setenv("NEBULA_QUIET", "1")
    args = toy().parse_args(["run", "--work-dir", "w", "--steps", "7", "--codec", "none"])
    assert (args.steps, args.codec, args.quiet) == (7, ["none"], True)  # a list given replaces the variable's
    monkeypatch.setenv("NEBULA_QUIET", "false")
    assert toy().parse_args(["run", "--work-dir", "w", "--quiet"]).quiet is True
    assert toy().parse_args(["run", "--work-dir", "w"]).quiet is False


@pytest.mark.parametrize("name, value, says", [
    ("STEPS", "forty", "NEBULA_STEPS='forty' (for --steps): invalid int value: 'forty'"),
    ("SCHEDULE", "async", "NEBULA_SCHEDULE='async' (for --schedule): invalid choice: 'async'"),
    ("QUIET", "maybe", "NEBULA_QUIET='maybe' (for --quiet): expected one of 1, on, true, yes or 0, false, no, off"),
    ("SETTING", "fp16 int8 none", "NEBULA_SETTING='fp16 int8 none' (for --setting): expected groups of 2 values"),
])
def test_a_bad_value_is_a_usage_error_naming_the_variable(monkeypatch, capsys, name, value, says):
    monkeypatch.setenv(f"NEBULA_{name}", value)
    with pytest.raises(SystemExit) as exc:
        toy().parse_args(["run", "--work-dir", "w"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: toy run") and f"toy run: error: environment variable {says}" in err


def test_only_the_command_that_runs_reads_its_variables(monkeypatch):
    monkeypatch.setenv("NEBULA_STEPS", "forty")  # an option of `run`, not of `other`
    monkeypatch.setenv("NEBULA_NAME", "y")
    assert toy().parse_args(["other"]).name == "y"


def test_the_real_commands_read_their_variables(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NEBULA_RUN_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("NEBULA_JOB", "deploy/jobs/abnet-es-en.toml")
    monkeypatch.setenv("NEBULA_WORKDIR", str(tmp_path / "w"))
    parser = build_parser()
    assert parser.parse_args(["demo"]).run_dir == tmp_path / "mine"
    assert parser.parse_args(["demo", "--run-dir", "runs/other"]).run_dir == Path("runs/other")
    one = build_parser().parse_args(["stage", "one-site"])  # both of its required options from the variables
    assert (one.job, one.workdir) == ("deploy/jobs/abnet-es-en.toml", str(tmp_path / "w"))
    monkeypatch.setenv("NEBULA_STEPS", "0")
    assert main(["demo"]) == 2 and "--steps 0: must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "mine").exists()
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--run-dir from NEBULA_RUN_DIR, and likewise for the others; an option given here wins" in help_text
    assert f"Set now: NEBULA_JOB=deploy/jobs/abnet-es-en.toml, NEBULA_STEPS=0, NEBULA_RUN_DIR={tmp_path / 'mine'}" \
        in help_text


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"nebula {version('nebula-i')}\n"


def test_help_says_what_nebula_is_how_to_start_and_where_the_docs_are(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "trains one deep-learning model across remote sites" in out
    start = out.index("start here, in this order:")
    order = [out.index(f"  nebula {name} ", start) for name in ("demo", "data", "keys", "stage", "audit")]
    assert order == sorted(order)
    assert "NEBULA_FOO_BAR" in out and "an option given on the command line wins" in out
    assert "docs: `nebula COMMAND --help`; the guides in " in out and "runtime.md (job files)" in out


def test_every_site_command_reads_the_site_config_from_nebula_site_config_and_keys_alone_read_nebula_dir(
        monkeypatch):
    monkeypatch.setenv("NEBULA_SITE_CONFIG", "/srv/nebula/a/site.toml")
    monkeypatch.setenv("NEBULA_DIR", "/srv/keys")
    parser = build_parser()
    for argv in (["site", "up"], ["site", "down"], ["site", "status"], ["site", "logs"],
                 ["site", "restart", "--service", "gateway"], ["site", "trust", "b.bundle.json", "--endpoint", "e",
                                                              "--fingerprint", "f"],
                 ["job", "list"], ["user", "list"], ["data", "list"]):
        args = parser.parse_args(argv)
        assert (getattr(args, "config", None) or args.site_config) == Path("/srv/nebula/a/site.toml"), argv
    assert parser.parse_args(["keys", "list"]).dir == Path("/srv/keys")
    with pytest.raises(SystemExit):  # NEBULA_DIR is the key store root, never `site init`'s directory
        parser.parse_args(["site", "init", "a", "--public", "tcp://x:1"])
    monkeypatch.setenv("NEBULA_SITE_DIR", "/srv/nebula/a")
    assert parser.parse_args(["site", "init", "a", "--public", "tcp://x:1"]).dir == Path("/srv/nebula/a")
