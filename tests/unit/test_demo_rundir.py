"""`nebula demo` deletes nothing it did not write: every argument is checked before the run directory
is touched, a directory holding a user's files is refused, and only an earlier demo's is emptied."""
from pathlib import Path

import pytest

from nebula.cli import main
from nebula.commands.demo import MARK, fresh_run_dir, job_copy
from nebula.errors import ConfigError
from nebula.shipped import shipped_jobs

ROOT = Path(__file__).resolve().parents[2]


def user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("mine")
    return path


def refused(capsys, *argv) -> str:
    assert main(["demo", *map(str, argv)]) == 2
    return capsys.readouterr().err


def test_a_bad_hot_start_leaves_a_users_run_dir_as_it_was(tmp_path, capsys):
    run = user_dir(tmp_path / "run")
    err = refused(capsys, "--run-dir", run, "--hot-start", tmp_path / "no-such-run")
    assert "--hot-start" in err and "no checkpoints in" in err and "nebula stage one-site" in err
    assert sorted(p.name for p in run.iterdir()) == ["thesis.tex"]
    assert (run / "thesis.tex").read_text() == "mine"


def test_a_run_dir_holding_a_users_files_is_refused_whole(tmp_path, capsys):
    run = user_dir(tmp_path / "run")
    (run / "figures").mkdir()
    err = refused(capsys, "--run-dir", run, "--steps", 3)
    assert f"--run-dir {run} already holds files that `nebula demo` did not write" in err
    assert "does not delete them" in err and "pass another --run-dir" in err
    assert sorted(p.name for p in run.iterdir()) == ["figures", "thesis.tex"]


def test_the_electra_demo_checks_its_arguments_before_the_run_dir(tmp_path, capsys):
    run = user_dir(tmp_path / "run")
    err = refused(capsys, "electra", "--run-dir", run, "--one-site-steps", 10_000)
    assert "--one-site-steps 10000: must be 1 to 1999" in err
    assert "already holds files" in refused(capsys, "electra", "--run-dir", run)
    assert sorted(p.name for p in run.iterdir()) == ["thesis.tex"]


def test_bad_steps_and_unknown_jobs_are_named(tmp_path, capsys):
    assert "--steps 0: must be a positive integer" in refused(capsys, "--run-dir", tmp_path / "r", "--steps", 0)
    err = refused(capsys, "--run-dir", tmp_path / "r", "--job", "abnet-xx-en")
    assert "job file abnet-xx-en not found" in err and "abnet-es-en" in err
    assert not (tmp_path / "r").exists()


def test_a_hot_start_inside_the_run_dir_is_refused_before_it_is_emptied(tmp_path, capsys):
    run = tmp_path / "run"
    fresh_run_dir(run)
    for stage in ("encoder", "decoder"):
        (run / "one-site" / stage / "checkpoints").mkdir(parents=True)
        (run / "one-site" / stage / "checkpoints" / "step-00000010.pt").write_bytes(b"weights")
    err = refused(capsys, "--run-dir", run, "--hot-start", run / "one-site")
    assert "lies inside --run-dir" in err
    assert (run / "one-site" / "encoder" / "checkpoints" / "step-00000010.pt").read_bytes() == b"weights"


def test_an_earlier_demos_run_dir_is_emptied_and_nothing_beyond_it(tmp_path):
    outside = user_dir(tmp_path / "elsewhere")
    run = tmp_path / "run"
    fresh_run_dir(run)
    assert [p.name for p in run.iterdir()] == [MARK]
    (run / "logs").mkdir()
    (run / "logs" / "gateway-a.log").write_text("old")
    (run / "loss.png").write_bytes(b"png")
    (run / "link").symlink_to(outside)  # removed as a link: what it points at is not the demo's
    fresh_run_dir(run)
    assert [p.name for p in run.iterdir()] == [MARK]
    assert (outside / "thesis.tex").read_text() == "mine"


def test_a_file_is_no_run_dir(tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        fresh_run_dir(tmp_path / "notes")
    assert (tmp_path / "notes").read_text() == "mine"


def test_the_job_copy_points_at_the_checkouts_data(tmp_path):
    raw = job_copy(shipped_jobs()["abnet-es-en"], steps=7)
    assert raw["job"]["data"] == str(ROOT / "data" / "es-en") and raw["train"]["steps"] == 7
    granted = tmp_path / "granted.toml"  # a data set read through a grant is a name, not a directory
    granted.write_text(shipped_jobs()["abnet-es-en"].read_text().replace('"../../data/es-en"', '"dataset:es-en"'))
    assert job_copy(granted)["job"]["data"] == "dataset:es-en"
