"""A site with a CA store, a site config and a data root, for the accounts, grants and jobs tests."""
from __future__ import annotations

import os
from pathlib import Path

from nebula.site.builder import local_sites


def make_site(root: Path, name: str = "a", data: bool = True) -> Path:
    """Site `name` as nebula.site.builder builds one: root/keys/<name> (its CA store; the gateway
    certified), root/data (a data root), root/site-<name>.toml; returns the config."""
    (root / "data").mkdir(exist_ok=True)
    return local_sites(root, [name], data=[root / "data"] if data else (), days=1)[name]


def secret_file(path: Path, secret: str) -> Path:
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return path


def cli_runner(monkeypatch, capsys, commands: list[str]):
    """`nebula ARGS` in this process with only `commands` built in (and no secret in the environment);
    returns (exit code, stdout, stderr)."""
    from nebula import cli

    monkeypatch.setattr(cli, "COMMANDS", commands)
    monkeypatch.delenv("NEBULA_SECRET", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run
