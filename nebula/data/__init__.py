"""Parallel corpora: building one from Debian translation packages, and reading one side of it per site.

Training stages need only `ParallelSide` and `check_aligned` (nebula/data/corpus.py); the rest is
`nebula data prepare`. The file format is described in docs/data.md.
"""
from nebula.data.corpus import ParallelSide, check_aligned

__all__ = ["ParallelSide", "check_aligned"]
