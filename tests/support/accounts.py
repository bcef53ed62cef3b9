"""A site with a CA store, a site config and a data root, for the accounts, grants and jobs tests."""
from __future__ import annotations

import os
from pathlib import Path

from nebula.security.keystore import SiteKeyStore
from nebula.site.config import write_site_config
from nebula.site.supervisor import free_port


def make_site(root: Path, name: str = "a", data: bool = True) -> Path:
    """root/keys/<name> (CA store), root/data (a data root), root/site-<name>.toml; returns the config."""
    SiteKeyStore.init(root / "keys", name)
    (root / "data").mkdir(exist_ok=True)
    table = {"site": {"name": name, "ca": f"keys/{name}", "credentials": f"credentials/{name}", "run": f"run-{name}"},
             "gateway": {"internal": f"tcp://127.0.0.1:{free_port()}", "external": f"tcp://127.0.0.1:{free_port()}"}}
    if data:
        table["site"]["data"] = ["data"]
    path = root / f"site-{name}.toml"
    write_site_config(path, table)
    return path


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
