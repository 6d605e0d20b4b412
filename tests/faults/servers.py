"""Private PostgreSQL servers that fault tests may stop and restart (the private Redis is
``tools.harness.PrivateRedis``).

The machine's shared servers (127.0.0.1:6379 and :5432) are never touched: each server here runs
on a free port in a temporary directory, belongs to the test that started it and is torn down by
its fixture (``tests/faults/conftest.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PostgresUnavailable(Exception):
    """A private PostgreSQL cluster could not be created or started here; the message says why."""


def _as_postgres(args: list[str]) -> subprocess.CompletedProcess[str]:
    """PostgreSQL refuses to run as root: run its tools as the ``postgres`` user then."""
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            raise PostgresUnavailable("running as root and runuser is missing: cannot run PostgreSQL as postgres")
        args = ["runuser", "-u", "postgres", "--", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


class PrivatePostgres:
    """A throw-away PostgreSQL 15 cluster (trust auth, fsync off) on a free port.

    Its data directory lives in a fresh temporary directory owned by ``postgres`` (pytest's own
    temporary directories are private to root). ``stop`` is a fast shutdown: connections are cut
    and the port refuses new ones, as when the database server goes down; ``start`` brings the
    same cluster back with its data.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.root = Path(tempfile.mkdtemp(prefix="pulse-faults-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.running = False

    def create(self) -> None:
        for tool in ("initdb", "pg_ctl"):
            if not (PG_BIN / tool).exists():
                raise PostgresUnavailable(f"{PG_BIN / tool} not found (Debian's postgresql-15 provides it)")
        if os.geteuid() == 0:
            shutil.chown(self.root, user="postgres", group="postgres")
        out = _as_postgres(
            [str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"]
        )
        if out.returncode != 0:
            raise PostgresUnavailable(f"initdb failed (rc={out.returncode}): {out.stderr.strip()[-500:]}")

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off"
        out = _as_postgres(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", opts, "start"]
        )
        if out.returncode != 0:
            tail = self.log.read_text(errors="replace")[-800:] if self.log.exists() else ""
            raise PostgresUnavailable(f"pg_ctl start failed (rc={out.returncode}): {out.stderr.strip()} {tail}")
        self.running = True

    def stop(self) -> None:
        if not self.running:
            return
        out = _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"])
        if out.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed (rc={out.returncode}): {out.stderr.strip()}")
        self.running = False

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
