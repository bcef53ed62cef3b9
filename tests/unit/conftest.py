"""Fixtures for unit tests: the real pre-trained models ABNet builds on, loaded once per module, and torch
on one thread for a module of small ops (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
from __future__ import annotations

import pytest

from services.models.minilm import load_minilm
from services.models.plm import Pretrained
from services.models.xlmr_e5 import load_e5_small
from tests.support import threads


@pytest.fixture(scope="module")
def one_thread():
    with threads.one_thread():
        yield


@pytest.fixture(scope="module")
def e5() -> Pretrained:
    return load_e5_small()


@pytest.fixture(scope="module")
def minilm() -> Pretrained:
    return load_minilm()
