"""Fixtures for the deployment-file tests (deploy/, docker-compose.yml)."""

from __future__ import annotations

import pytest
from deploy_files import require_tool


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture(scope="session")
def amtool() -> str:
    return require_tool("amtool")
