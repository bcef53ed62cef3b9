"""A stage package written outside Nebula's tree (tests/fixtures/plugin_stage), installed with pip into a new
environment beside Nebula's own wheel, is chosen by its entry-point name in a job file and runs in
`nebula stage one-site`; a stage package that fails to import is an error naming its entry point."""
import json
import shutil
from pathlib import Path

import pytest

from tests.support.venv import REPO, build_wheel, copy_tree, make_venv, ok, pip_install, run

FIXTURE = REPO / "tests" / "fixtures" / "plugin_stage"


@pytest.fixture(scope="module")
def nebula_wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nebula-wheel")
    return build_wheel(copy_tree(REPO, root / "src"), root / "dist")


def environment(root: Path, wheel: Path, package: Path) -> Path:
    """Nebula's wheel and the stage package at `package` (built from a copy: no build/ in the checkout)."""
    python = make_venv(root / "venv")
    pip_install(python, wheel, shutil.copytree(package, root / package.name, ignore=shutil.ignore_patterns("broken")))
    return python.parent


def one_site(bin_dir: Path, job: Path, cwd: Path):
    return run([bin_dir / "nebula", "stage", "one-site", "--job", job, "--workdir", cwd / "work"], cwd)


def test_an_installed_stage_package_runs_in_a_job(tmp_path, nebula_wheel):
    bin_dir = environment(tmp_path, nebula_wheel, FIXTURE)
    done = ok(one_site(bin_dir, FIXTURE / "job.toml", tmp_path))
    assert "one-site run done" in done.stdout
    ran = json.loads((tmp_path / "work" / "scale" / "plugin-scale.json").read_text())
    assert ran["steps"] == list(range(1, 7))  # every step of the job applied once by the package's stage
    assert Path(ran["module"]).is_relative_to(tmp_path / "venv")  # the installed copy, not the fixture
    assert any(abs(s - 1.0) > 1e-4 for s in ran["scale"])  # it trained: gradients came back through it
    steps = [json.loads(line) for line in (tmp_path / "work" / "sink" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == list(range(1, 7))


def test_a_stage_package_that_fails_to_import_is_named(tmp_path, nebula_wheel):
    bin_dir = environment(tmp_path, nebula_wheel, FIXTURE / "broken")
    job = tmp_path / "job.toml"
    job.write_text((FIXTURE / "job.toml").read_text().replace('"plugin-scale"', '"plugin-broken"'))
    done = one_site(bin_dir, job, tmp_path)
    assert done.returncode == 2, done.stderr
    assert ("nebula: error: stage plugin plugin-broken (nebula_plugin_broken.stages:Broken) cannot be imported: "
            "ModuleNotFoundError: No module named 'nebula_plugin_missing_dependency'") in done.stderr
    assert not (tmp_path / "work").exists()
