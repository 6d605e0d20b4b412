"""The coordinator of ``pulse check reroute``: it hosts the ranks' ``TCPStore``, starts
``world_size`` ranks (``python -m tools.check_reroute.rank``) on this machine, waits for their
result files and returns :func:`~tools.check_reroute.check.summarize` of them. Raises
:class:`CheckError` for a bad config and :class:`CheckFailed` when a rank did not deliver."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from tools.check_reroute.check import DONE_KEY, POLL_S, CheckConfig, CheckFailed, make_plan, summarize

log = logging.getLogger(__name__)


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """Run the check (docs/design/check-reroute.md) and return its summary; raises :class:`CheckError`
    for a bad config and :class:`CheckFailed` when the ranks did not all deliver."""
    cfg.validate()
    plan = make_plan(cfg.world_size, cfg.degrade, cfg.exclude)
    # The store lives here, not in rank 0: a SIGSTOPped rank 0 would take the store with it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    config = json.dumps(dataclasses.asdict(cfg))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="pulse-check-reroute-") as tmp:
        out_dir = Path(tmp)
        logs = {r: out_dir / f"rank{r}.log" for r in range(cfg.world_size)}
        try:
            for r in range(cfg.world_size):
                with logs[r].open("wb") as fh:
                    procs[r] = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tools.check_reroute.rank",
                            "worker",
                            config,
                            str(r),
                            str(store.port),
                            tmp,
                        ],
                        env=env,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            log.info("check reroute started world_size=%d plan=%s hang=%s", cfg.world_size, plan.proxies, cfg.hang)
            wanted = {r: [out_dir / f"rank{r}.json"] for r in range(cfg.world_size)}
            if cfg.hang is not None:
                for r in range(cfg.world_size):
                    wanted[r] += [] if r == cfg.hang else [out_dir / f"rank{r}.hang.json"]
            _wait_for_files(wanted, procs, logs, deadline=time.monotonic() + cfg.timeout_s)
            results = {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg.world_size)}
            hang = {
                r: json.loads((out_dir / f"rank{r}.hang.json").read_text())
                for r in range(cfg.world_size)
                if (out_dir / f"rank{r}.hang.json").exists()
            }
            store.set(DONE_KEY, "1")
            _wait_for_exit(procs, hang=cfg.hang, deadline=time.monotonic() + 10)
        finally:
            _stop_all(procs)
    return summarize(cfg, plan, results, hang)


def _wait_for_files(
    wanted: dict[int, list[Path]],
    procs: dict[int, subprocess.Popen[bytes]],
    logs: dict[int, Path],
    *,
    deadline: float,
) -> None:
    """Poll until every rank's files exist; fail as soon as a rank exits without them."""
    while True:
        if all(p.exists() for paths in wanted.values() for p in paths):
            return
        for rank, proc in procs.items():
            rc = proc.poll()  # None for a running or a stopped (the hung) rank
            if rc is not None and not all(p.exists() for p in wanted[rank]):
                raise CheckFailed(f"rank {rank} exited with {rc} before delivering its results\n" + _tails(logs))
        if time.monotonic() > deadline:
            late = [p.name for paths in wanted.values() for p in paths if not p.exists()]
            raise CheckFailed(f"no {', '.join(late)} within --timeout; rank logs follow\n" + _tails(logs))
        time.sleep(POLL_S)


def _wait_for_exit(procs: dict[int, subprocess.Popen[bytes]], *, hang: int | None, deadline: float) -> None:
    """Give the ranks (all but the hung one) a moment to leave by themselves."""
    while time.monotonic() < deadline and any(p.poll() is None for r, p in procs.items() if r != hang):
        time.sleep(POLL_S)


def _stop_all(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Kill what is left (the hung rank above all: SIGKILL ends a stopped process too), by pid."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("check reroute rank pid=%d did not exit after SIGKILL", proc.pid)


def _tails(logs: dict[int, Path]) -> str:
    return "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-2000:]}" for r, p in logs.items() if p.exists())
