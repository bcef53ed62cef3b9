"""A wheel built from the repository runs `nebula` without a checkout: installed into a fresh environment and
run from a directory outside the repository, it finds its shipped job files (deploy/ and docs/ are package
data, nebula.shipped) and reads a shipped job's data from ./data, where `nebula data prepare` writes.

The whole demo from the wheel takes minutes, too long for the suite; docs/operate.md §11 gives its measured time."""
import re
from pathlib import Path

import pytest

from tests.support.venv import REPO, build_wheel, copy_tree, make_venv, ok, pip_install, run


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of this checkout installed into a new environment; -> that environment's bin/."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(copy_tree(REPO, root / "src"), root / "dist")
    python = make_venv(root / "venv")
    pip_install(python, wheel)
    return python.parent


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    assert not tmp_path.resolve().is_relative_to(REPO)
    return tmp_path


def test_the_wheel_carries_the_shipped_files_and_imports_from_itself(installed, elsewhere):
    code = ("import nebula, services; from nebula import shipped; from nebula.commands.demo import job_copy; "
            "print(nebula.__file__, services.__file__, shipped.in_checkout(), shipped.docs_dir(), sep='\\n'); "
            "print(*shipped.shipped_jobs(), sep=' '); "
            "print(job_copy(shipped.shipped_jobs()['abnet-es-en'])['job']['data'])")
    lines = ok(run([installed / "python", "-c", code], elsewhere)).stdout.splitlines()
    site_packages = Path(lines[0]).parents[1]
    assert site_packages.is_relative_to(installed.parent) and Path(lines[1]).parents[1] == site_packages
    assert lines[2] == "False" and lines[3] == str(site_packages / "nebula" / "_docs")
    assert set(lines[4].split()) == {p.stem for p in (REPO / "deploy" / "jobs").glob("*.toml")}
    assert lines[5] == str(elsewhere / "data" / "es-en")  # not a directory inside site-packages
    for shipped in (REPO / "deploy" / "jobs").glob("*.toml"):
        assert (site_packages / "nebula" / "_deploy" / "jobs" / shipped.name).read_bytes() == shipped.read_bytes()


def test_the_wheel_finds_its_workloads_and_stages_through_the_one_group(installed, elsewhere):
    code = ("from nebula import workload; from nebula.runtime.registry import registered_stages, resolve_stage; "
            "specs = workload.installed(); print(*sorted(specs.loaded), sep=' '); print(specs.broken); "
            "print(*registered_stages(), sep=' '); print(resolve_stage('abnet-encoder').__module__)")
    lines = ok(run([installed / "python", "-c", code], elsewhere)).stdout.splitlines()
    assert lines[0].split() == ["abnet", "corpus", "electra", "example", "gpt", "lab", "replicas", "split"] \
        and lines[1] == "{}"
    assert {"abnet-encoder", "abnet-decoder", "electra-generator", "electra-discriminator", "example-source",
            "example-middle", "example-sink", "gpt-first", "gpt-middle", "gpt-last", "gpt-whole", "split"
            } == set(lines[2].split())
    assert lines[3] == "services.abnet.stages"
    commands = ok(run([installed / "nebula", "--help"], elsewhere)).stdout
    assert all(re.search(rf"^    {name}\b", commands, re.M) for name in ("demo", "data", "translate", "bench", "wan"))
    assert "prepare" in ok(run([installed / "nebula", "data", "--help"], elsewhere)).stdout


def test_version_and_help_from_the_wheel(installed, elsewhere):
    version = ok(run([installed / "python", "-c", "import nebula; print(nebula.__version__)"], elsewhere))
    assert ok(run([installed / "nebula", "--version"], elsewhere)).stdout == f"nebula {version.stdout}"
    out = ok(run([installed / "nebula", "--help"], elsewhere)).stdout
    assert "start here, in this order:" in out and str(installed.parent) in out.split("docs:")[1]
    demo = ok(run([installed / "nebula", "demo", "--help"], elsewhere)).stdout
    assert "--hot-start" in demo and "--one-site-steps" in demo


def test_the_demos_load_their_shipped_job_files(installed, elsewhere):
    """Both demos check their job files, then the argument that is wrong (before writing anything)."""
    done = run([installed / "nebula", "demo", "--job", "abnet-zh-en", "--run-dir", "run", "--hot-start", "none"],
               elsewhere)
    assert done.returncode == 2
    assert "--hot-start none: no checkpoints in none/encoder/checkpoints" in done.stderr, done.stderr
    done = run([installed / "nebula", "demo", "electra", "--one-site-steps", "10000"], elsewhere)
    assert done.returncode == 2 and "--one-site-steps 10000: must be 1 to 1999" in done.stderr, done.stderr
    assert list(elsewhere.iterdir()) == []
