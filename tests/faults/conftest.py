"""Fixtures of the fault-injection suite: private Redis and PostgreSQL servers a test may stop.

Never the machine's shared servers: a test that stops Redis or PostgreSQL stops its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.servers import PostgresUnavailable, PrivatePostgres
from tools.harness import PrivateRedis


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A running private Redis (no persistence) on a free port; stopped at the end."""
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A running private PostgreSQL cluster on a free port; skipped, saying why, when none can
    be created here (no PostgreSQL 15 binaries, no ``postgres`` user)."""
    server = PrivatePostgres()
    try:
        try:
            server.create()
            server.start()
        except PostgresUnavailable as exc:
            pytest.skip(f"no private PostgreSQL: {exc}")
        yield server
    finally:
        server.stop()
        server.remove()
