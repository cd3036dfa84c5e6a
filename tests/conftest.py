"""Fixtures shared by the tests."""

from __future__ import annotations

import logging
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _atorch_cache(tmp_path_factory):
    """The search's study and the hardware profile go to a directory of this test session, never to
    the user's ~/.cache/atorch (worker processes inherit the variable)."""
    before = os.environ.get("ATORCH_CACHE_DIR")
    os.environ["ATORCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("atorch-cache"))
    yield
    if before is None:
        os.environ.pop("ATORCH_CACHE_DIR", None)
    else:
        os.environ["ATORCH_CACHE_DIR"] = before


@pytest.fixture
def atorch_log(caplog):
    """atorch's records propagate to the root logger, where caplog listens; at INFO for the test."""
    caplog.set_level(logging.INFO, logger="atorch")
    return caplog
