"""Fixtures shared by the tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def atorch_log(caplog):
    """atorch's logger does not propagate to the root logger, so attach caplog's handler to it."""
    logger = logging.getLogger("atorch")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
