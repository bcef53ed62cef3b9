"""Throw-away virtual environments for the tests that install Nebula's wheel, or a stage package, the way a
user does, and run `nebula` from them outside the checkout.

The environments reuse the test interpreter's packages (torch, pyzmq, ...) instead of downloading them.
`python -m venv --system-site-packages` would not do: the test interpreter is itself a virtual
environment, and that flag reaches the base interpreter's packages, not this environment's. A .pth file
in the new environment adds this interpreter's site-packages after its own, so what the test installs
there (nebula-i's wheel, a stage package) comes first, metadata and entry points included.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def run(argv: list, cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """`argv` with no NEBULA_* or PYTHONPATH of the caller's: as on a user's machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_") and k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"{' '.join(done.args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def copy_tree(src: Path, dest: Path) -> Path:
    """The files of `src` that git tracks or would track, symbolic links kept: a build writes its build/ and
    egg-info into the copy, never into the checkout; nothing ignored (keys, runs, data) reaches a wheel."""
    names = ok(run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], src)).stdout
    for name in filter(None, names.split("\0")):
        path = src / name
        if not (path.is_symlink() or path.is_file()):  # deleted, not yet committed
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            (dest / name).symlink_to(os.readlink(path))
        else:
            (dest / name).write_bytes(path.read_bytes())
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    """pip's wheel of the project at `src`, built with this interpreter's setuptools (no index)."""
    ok(run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
            src, "-w", out], src))
    (wheel,) = out.glob("*.whl")
    return wheel


def make_venv(path: Path) -> Path:
    """A new environment at `path` that sees this interpreter's packages after its own; -> its python."""
    ok(run([sys.executable, "-m", "venv", "--without-pip", path], path.parent))
    python = path / "bin" / "python"
    own = ok(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path)).stdout.strip()
    Path(own, "_test_interpreter_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def pip_install(python: Path, *what: Path) -> None:
    """Install `what` (wheels, project directories) into `python`'s environment: no index, no dependencies
    (they are the test interpreter's), built with the setuptools it sees."""
    ok(run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
            "--no-build-isolation", *what], python.parent))
