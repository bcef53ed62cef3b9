"""Parallel corpora: building one from Debian translation packages, and reading one side of it per site.

Training stages need only `ParallelSide` and `check_aligned` (services/corpus/corpus.py); the rest is
`nebula data prepare`. The file format is described in docs/data.md.
"""
from services.corpus.corpus import ParallelSide, check_aligned

__all__ = ["ParallelSide", "check_aligned"]
