"""Jobs that rendezvous at one address never share a port: a second store on a port cannot bind,
and the second job's ranks would join the first job's store (``services/jobs/decide.py``, master_port).
A real orchestrator on SQLite, one node, jobs placed over REST and left active."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.stack import AUTH, live_orchestrator

pytestmark = pytest.mark.timeout(120)

JOB = {"name": "p", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["train.py"]}


def test_active_jobs_at_one_address_hold_distinct_ports_and_one_more_than_the_span_is_refused(
    tmp_path: Path,
) -> None:
    with (
        live_orchestrator(
            tmp_path, f"sqlite:///{tmp_path / 'p.db'}", gpus=8, PULSE_JOB_PORT_BASE="32600", PULSE_JOB_PORT_SPAN="3"
        ) as stack,
        httpx.Client(base_url=stack.api, headers=AUTH, timeout=30) as http,
    ):
        ports = []
        for _ in range(3):
            r = http.post("/v1/jobs", json=JOB)
            assert r.status_code == 201, r.text
            ports.append(http.get(f"/v1/jobs/{r.json()['id']}").json()["master_port"])
        assert sorted(ports) == [32600, 32601, 32602], ports  # each hashed port, or the next free one
        r = http.post("/v1/jobs", json=JOB)
        assert r.status_code == 409, r.text
        assert "no free rendezvous port" in r.text and "PULSE_JOB_PORT_BASE=32600 ... 32602" in r.text, r.text
        assert http.get("/v1/jobs").json()["count"] == 3  # nothing stored for the refused one
