"""Shared fixtures: the real Redis and PostgreSQL of the machine, SQLite files, process helpers.

Redis tests use database ``PULSE_TEST_REDIS_DB`` (default 9), flushed before each test. Database
tests run inside a transaction that is rolled back, on SQLite and on PostgreSQL alike.

DeepSpeed's CPU ops are compiled into ``TORCH_EXTENSIONS_DIR``, by default in this virtual
environment (``.venv/torch_extensions``): torch rebuilds an op whenever the build file names other
paths, so two checkouts sharing ``~/.cache/torch_extensions`` (a clean CI clone beside a working
tree) rebuild each other's ops and wait minutes on each other's lock files.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from services import db
from tests.support import PG_URL, REDIS_URL

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture
def redis_url() -> Iterator[str]:
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'pulse.db'}"


def _pg_reset() -> None:
    eng = db.make_engine(PG_URL)
    with eng.begin() as conn:
        conn.execute(
            text(
                "DROP TABLE IF EXISTS slurm_drains, leader_lease, tokens, plans, job_ranks, jobs, events, gpus, nodes, alembic_version CASCADE"
            )
        )
    eng.dispose()


@pytest.fixture(scope="session")
def postgresql_engine() -> Iterator[Engine]:
    _pg_reset()
    db.upgrade(PG_URL)
    eng = db.make_engine(PG_URL)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def sqlite_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'repo.db'}"
    db.upgrade(url)
    eng = db.make_engine(url)
    yield eng
    eng.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def session(request: pytest.FixtureRequest) -> Iterator[Session]:
    """A session inside a transaction rolled back at the end: nothing leaks between tests."""
    engine: Engine = request.getfixturevalue(f"{request.param}_engine")
    conn = engine.connect()
    trans = conn.begin()
    s = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
    try:
        yield s
    finally:
        s.close()
        trans.rollback()
        conn.close()
