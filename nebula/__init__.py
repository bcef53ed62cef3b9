"""Nebula: train one model across remote clusters joined by slow WAN links (Nebula-I)."""

__version__ = "0.1.0"
