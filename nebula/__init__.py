"""Nebula: train one model across remote clusters joined by slow WAN links (Nebula-I)."""
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "nebula-i"  # the name pyproject.toml gives the distribution
try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"
