"""Top-level `nebula` commands, one module each (see nebula/cli.py)."""
