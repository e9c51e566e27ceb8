"""Fixtures for the node link's tests: billing's fleet builders, and raw access to a node's queue."""

from __future__ import annotations

import pytest

from tests.billing.conftest import Fleet


@pytest.fixture
def fleet(rules):
    return Fleet()
