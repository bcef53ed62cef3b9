"""The mark of the tests that build network namespaces (nebula_lab.wanem): they skip, saying why, without root
and iproute2."""
from __future__ import annotations

import os
import shutil

import pytest

ROOT = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                          reason="needs root and iproute2 (ip, tc) for network namespaces")
