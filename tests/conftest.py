"""Shared fixtures: the real Redis and PostgreSQL of the machine, SQLite files, process helpers.

Redis tests use database ``PULSE_TEST_REDIS_DB`` (default 9), flushed before each test. Database
tests run inside a transaction that is rolled back, on SQLite and on PostgreSQL alike.

DeepSpeed's CPU ops are compiled into ``TORCH_EXTENSIONS_DIR``, by default in this virtual
environment (``.venv/torch_extensions``): torch rebuilds an op whenever the build file names other
paths, so two checkouts sharing ``~/.cache/torch_extensions`` (a clean CI clone beside a working
tree) rebuild each other's ops and wait minutes on each other's lock files.

Every process the tests start runs with ``OMP_NUM_THREADS=1`` unless the run sets it: the suite
runs several jobs' ranks at once on a few cores, and torch's OpenMP pools (one thread per core
in each rank) spin against each other; what torchrun and the agent do for several ranks on a
node (``clusterpulse.proc.rank_threads``), for the whole machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from services import db
from tests.redis_cluster import shared_url, started
from tests.support import CLUSTERS, JOB_PORT_BASE, REDIS_URL, REPO, collect_quietly, fresh_database
from tools.redis_cluster import PrivateRedisCluster

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


TWO_REDIS = "two_redis"
"""A module marked with it (``pytestmark``) runs each test that takes ``redis_url`` twice: on the
machine's Redis and on a real Redis Cluster of three masters (``-k cluster`` picks the second)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "redis_url" in metafunc.fixturenames and metafunc.definition.get_closest_marker(TWO_REDIS):
        metafunc.parametrize("redis_url", ["redis", "cluster"], indirect=True)


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedisCluster]:
    """This worker's Redis Cluster (three masters, no replicas), started at its first use."""
    cluster = started(tmp_path_factory.mktemp("redis-cluster"), replicas=0)
    CLUSTERS.add(cluster.url)
    try:
        yield cluster
    finally:
        CLUSTERS.discard(cluster.url)
        cluster.stop()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The machine's Redis (this worker's database, flushed), or with the ``cluster`` parameter
    (:data:`TWO_REDIS`) this worker's Cluster, flushed."""
    if getattr(request, "param", "redis") == "cluster":
        yield shared_url(request)
        collect_quietly()
        return
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'pulse.db'}"


@pytest.fixture(scope="session")
def postgresql_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The migrated schema this test session's transactions roll back in: a PostgreSQL schema of
    its own, so that parallel workers and other checkouts on the same server never collide."""
    with fresh_database("postgresql", tmp_path_factory.mktemp("pg")) as url:
        db.upgrade(url)
        eng = db.make_engine(url)
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


# Modules whose tests start multi-rank torch/DeepSpeed worlds: CPU-bound, and timed by collective
# and proxy timeouts of a few seconds. The suite runs on three workers (two cores) so that tests
# that wait fill the cores; at most HEAVY_AT_ONCE of these run at once, as on two workers: three
# at once on two cores starved survivors past their 3 s collective timeout in one run (4 failures).
# The schedule (pytest_xdist_make_scheduler) keeps to that by running them in HEAVY_AT_ONCE
# groups; the lock files (_heavy_slot) hold it under any other --dist too. Each module with its
# tests' wall time in seconds (a clean-clone three-worker run), what the groups are balanced by.
HEAVY = {
    "tests/e2e/test_any_script.py": 190,
    "tests/e2e/test_demo.py": 88,
    "tests/e2e/test_fabric_check.py": 94,
    "tests/e2e/test_frameworks.py": 396,
    "tests/e2e/test_goodput.py": 141,
    "tests/e2e/test_gpu_fault.py": 134,
    "tests/e2e/test_hung_rank.py": 136,
    "tests/e2e/test_job_ends.py": 57,
    "tests/e2e/test_job_start.py": 82,
    "tests/e2e/test_reroute.py": 40,
    "tests/e2e/test_step_breakdown.py": 80,
    "tests/e2e/test_trainer_example.py": 35,
    "tests/integration/test_any_script_exact.py": 112,
    "tests/integration/test_any_script_rejoin.py": 134,
    "tests/integration/test_check_reroute.py": 44,
    "tests/integration/test_collective_gloo.py": 37,
    "tests/integration/test_deepspeed_reroute.py": 51,
    "tests/integration/test_divergence_checkpoint.py": 10,
    "tests/integration/test_lightning_path.py": 25,
    "tests/integration/test_plan_follower.py": 20,
    "tests/integration/test_rejoin.py": 56,
    "tests/integration/test_slurm_jobs.py": 266,
    "tests/integration/test_trainer_exact.py": 76,
    "tests/integration/test_world_collectives.py": 16,
    "tests/integration/test_world_groups.py": 4,
    "tests/integration/test_zero_dead_rank.py": 44,
    "tests/integration/test_zero_repartition.py": 61,
}
HEAVY_AT_ONCE = 2
# After the heavy groups, the modules whose tests wait on processes and deadlines first; the many
# short unit tests fill the end, so that no worker is left with a long module while others idle.
WAITING_FIRST = ("tests/e2e/", "tests/faults/", "tests/integration/", "tests/deploy/", "tests/bench/")


def heavy_groups(heavy: dict[str, float], slots: int) -> dict[str, int]:
    """Each heavy module's group (0 ... slots - 1): the longest first, each to the group with the
    least time so far, so the groups take about equally long."""
    load = [0.0] * slots
    out: dict[str, int] = {}
    for module, seconds in sorted(heavy.items(), key=lambda kv: (-kv[1], kv[0])):
        i = load.index(min(load))
        out[module] = i
        load[i] += seconds
    return out


def _module(item: pytest.Item) -> str:
    """The test's module as HEAVY names it."""
    return str(item.path.relative_to(REPO))


def _heavy_grouped(config: pytest.Config) -> bool:
    """The run (the controller's options) takes the schedule below."""
    return bool(config.getoption("dist") == "loadfile")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n 3`` with ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml; README, Tests):
    each module is a unit that one worker runs whole, its module fixtures set up once, but the
    HEAVY modules joined into HEAVY_AT_ONCE units, each run by one worker from the start: at most
    HEAVY_AT_ONCE run at once and no worker waits for a heavy slot. (``--dist loadgroup`` with
    ``xdist_group`` marks would say the same, but pytest-xdist 3.8 names a group by rewriting
    ``item._nodeid``, which pytest 9.2 ignores.)"""
    if not _heavy_grouped(config):
        return None
    from xdist.scheduler import LoadFileScheduling

    groups = heavy_groups(HEAVY, HEAVY_AT_ONCE)

    class HeavyGrouped(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return f"heavy-{groups[module]}" if module in groups else module

    return HeavyGrouped(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """This process's jobs (and what it starts: ``harness.child_env`` keeps the setting) take
    their rendezvous ports from this worker's own range (tests/support.py JOB_PORT_BASE)."""
    os.environ["PULSE_JOB_PORT_BASE"] = str(JOB_PORT_BASE)


def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller: tell each worker whether the schedule above is in use."""
    node.workerinput["heavy_grouped"] = _heavy_grouped(node.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker under the schedule above: the heavy groups' tests first (it hands the
    units out in this order, ``--no-loadscope-reorder``), then the other modules in the order of
    WAITING_FIRST; a module's tests keep their order."""
    if not getattr(config, "workerinput", {}).get("heavy_grouped"):
        return
    groups = heavy_groups(HEAVY, HEAVY_AT_ONCE)

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = _module(item)
        if module in groups:
            return (0, groups[module])
        return (1, next((i for i, d in enumerate(WAITING_FIRST) if module.startswith(d)), len(WAITING_FIRST)))

    items[:] = sorted(items, key=rank)


@contextlib.contextmanager
def _heavy_slot(item: pytest.Item) -> Iterator[None]:
    """For a test of a HEAVY module, one of HEAVY_AT_ONCE lock files shared by this run's workers
    (xdist's run id names them), held while it runs; others pass straight through."""
    if _module(item) not in HEAVY:
        yield
        return
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    paths = [Path(tempfile.gettempdir()) / f"pulse-heavy-{run}-{i}.lock" for i in range(HEAVY_AT_ONCE)]
    while True:
        for path in paths:
            f = path.open("w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(0.2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The slot is held around the whole protocol, not taken by a fixture: a module's fixtures
    set up with its first test (a gloo world run in a module fixture) and torn down with its last
    are inside it too; an autouse fixture would come after them."""
    with _heavy_slot(item):
        yield
