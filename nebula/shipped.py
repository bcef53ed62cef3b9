"""The files that ship with Nebula (deploy/: job, site and Docker files; docs/), found the same way in a
checkout and in an installed wheel.

The repository keeps deploy/ and docs/ at its top (DESIGN). `nebula/_deploy` and `nebula/_docs` are
symbolic links to them: setuptools follows the links and packs those files into the wheel as package
data (pyproject.toml), so both a checkout and an installation find them beside this module.

A shipped file names other places relative to itself, e.g. a job's `data = "../../data/es-en"`: in a
checkout that is the repository's data/. In an installation it would point into site-packages, so there
the working directory stands in for the checkout: `./data/es-en`, where `nebula data prepare` writes by
default (and where the Docker image's WORKDIR keeps it).
"""
from __future__ import annotations

from pathlib import Path

from nebula.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent
DEPLOY = PACKAGE / "_deploy"
DOCS = PACKAGE / "_docs"


def deploy_dir() -> Path:
    """deploy/ of this checkout or installation (resolved: the repository's own deploy/ in a checkout)."""
    for candidate in (DEPLOY, PACKAGE.parent / "deploy"):  # the second: a checkout made without symlinks
        if (candidate / "jobs").is_dir():
            return candidate.resolve()
    raise ConfigError(f"Nebula's shipped job files are missing ({DEPLOY}/jobs): reinstall Nebula, or run from a "
                      "checkout of its repository")


def docs_dir() -> Path | None:
    """docs/ of this checkout or installation; None where it was left out (the Docker image ships no docs)."""
    for candidate in (DOCS, PACKAGE.parent / "docs"):
        if candidate.is_dir():
            return candidate.resolve()
    return None


def in_checkout() -> bool:
    """Whether deploy/ is a repository's (outside the package) rather than a copy installed with it."""
    return not deploy_dir().is_relative_to(PACKAGE)


def shipped_jobs() -> dict[str, Path]:
    """Job name (the file name without .toml) -> the shipped job file."""
    return {path.stem: path for path in sorted((deploy_dir() / "jobs").glob("*.toml"))}


def job_file(arg: str | Path) -> Path:
    """A job file given on the command line: a path, or the name of a shipped job (NAME for deploy/jobs/NAME.toml)."""
    path = Path(arg)
    if path.exists():
        return path
    jobs = shipped_jobs()
    name = path.name.removesuffix(".toml")
    if path.parent == Path(".") and name in jobs:
        return jobs[name]
    raise ConfigError(f"job file {arg} not found; give a path, or the name of a shipped job: "
                      f"{', '.join(jobs)} (in {deploy_dir() / 'jobs'})")


def data_dir(job: Path, data: str) -> Path:
    """The absolute data directory that the job file `job` names as `data` (relative to the file).

    A job file shipped inside an installation resolves as if it were ./deploy/jobs/NAME.toml in the
    working directory: its "../../data/X" is then ./data/X, not a directory inside site-packages."""
    base = job.resolve().parent
    deploy = deploy_dir()
    if not in_checkout() and base.is_relative_to(deploy):
        base = Path.cwd() / "deploy" / base.relative_to(deploy)
    return (base / data).resolve()
