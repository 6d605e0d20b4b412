"""The fabric check (issue 33, item 4), end to end: a real orchestrator, eight `pulse agent`
processes (simulated telemetry, real launcher), real probes (gloo all-reduces between two ranks
on loopback). One agent runs with the ``slow_link`` fault: the ranks it launches have their
collectives held to 0.002 GB/s, nothing in its telemetry says so.

- A job that asks for the preflight, placed on the slow node among others, waits PENDING while
  its nodes and two spares are probed, and is placed without the slow node.
- ``pulse check fabric --nodes ... --json`` over the eight names the slow node, within two
  rounds, with every pair's figure; the node is SUSPECT with the check's reason.

The rounds and the verdict themselves: tests/unit/test_fabric_decide.py."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from tests.stack import TOKEN, Stack, write_heartbeat
from tests.support import PULSE, REDIS_URL, REPO, pulse_env, spawn, wait_for
from tools.format import format_fabric_check

pytestmark = pytest.mark.e2e

NODES = [f"fab-{i}" for i in range(8)]
SLOW = "fab-1"
RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")
FLOOR_GBPS = 0.006  # above the slow link's 0.002, below what a healthy loopback pair reaches


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(
        tmp_path,
        PULSE_FABRIC_PROBE_BYTES=str(1 << 20),  # 1 MiB: 1-100 ms on a loaded loopback, 500 ms held to 0.002 GB/s
        PULSE_FABRIC_PROBE_ITERS="5",
        PULSE_FABRIC_PROBE_TIMEOUT_S="90",
        PULSE_FABRIC_PREFLIGHT_SPARES="2",
        # healthy pairs measure 0.01-1 GB/s here (gloo paced by a loaded scheduler, several probes at
        # once beside other tests), and a fraction of the median misnamed a healthy partner once; the
        # slow link is held to 0.002 GB/s: the floor tells them apart, the fraction alone never names
        PULSE_FABRIC_SLOW_FRACTION="0.01",
        PULSE_FABRIC_MIN_BUSBW_GBPS=str(FLOOR_GBPS),
        PULSE_DEGRADED_AFTER_S="10",  # eight agents and their probes on two cores: late heartbeats are not faults
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, *(["--fault", "slow_link@0"] if node == SLOW else []))
        s.wait_healthy(NODES, timeout=90)
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.close()


def test_the_slow_node_is_named_and_a_preflighted_job_is_placed_without_it(stack: Stack) -> None:
    body = {
        "name": "preflighted", "nodes": 2, "gpus_per_node": 1, "entrypoint": [RANK, "--seconds", "0.5"],
        "preflight": {"fabric": True},
    }  # fmt: skip
    r = stack.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "PENDING" and job["assigned_nodes"] == NODES[:2]  # the slow node among them
    assert "fabric preflight" in job["reason"] and f"(spares: {NODES[2]}, {NODES[3]})" in job["reason"]
    wait_for(lambda: stack.job(job["id"])["state"] != "PENDING", timeout=150, what="the preflight to end")
    placed = stack.job(job["id"])
    started = [e for e in stack.events(job=job["id"]) if e["kind"] == "fabric_check" and "started by" in e["reason"]]
    [check_id] = [e["reason"].split()[2] for e in started]
    preflight = stack.get(f"/v1/fabric/checks/{check_id}")
    assert preflight["job"] == job["id"] and preflight["slow"] == [SLOW], json.dumps(preflight)
    assert placed["assigned_nodes"] == [NODES[0], NODES[2]], placed  # the slow node swapped for the first spare
    stack.wait_state(job["id"], "SUCCEEDED", timeout=60)

    out = _check(stack, "--nodes", ",".join(NODES), "--json", timeout=150)
    assert out.returncode == 1, out.stdout + out.stderr  # 1: a node was named slow
    check = json.loads(out.stdout)
    assert check["state"] == "DONE" and check["slow"] == [SLOW], check
    rounds = {p["round"] for p in check["pairs"]}
    assert rounds == {1, 2}
    assert len([p for p in check["pairs"] if p["round"] == 1]) == 4  # every node once in round 1
    assert all(p["state"] == "done" and p["busbw_gbps"] > 0 for p in check["pairs"]), check["pairs"]
    with_slow = [p["busbw_gbps"] for p in check["pairs"] if SLOW in p["nodes"]]
    assert max(with_slow) < FLOOR_GBPS, check["pairs"]  # every pair it was in was slow
    assert f"floor {FLOOR_GBPS:g} GB/s" in check["slow_reasons"][SLOW]
    print(format_fabric_check(check))  # what `pulse check fabric` shows without --json
    node = stack.nodes()[SLOW]
    assert node["state"] == "SUSPECT" and "fabric check" in node["reason"], node  # since the preflight named it
    wait_for(  # this check's word, with the node's next heartbeat
        lambda: any(f"fabric check {check['id']}" in w for w in stack.nodes()[SLOW]["warnings"]),
        timeout=30,
        what=f"{SLOW}'s warning from check {check['id']}",
    )


def test_nodes_that_launch_nothing_are_not_probed_and_a_silent_agent_names_nobody(
    redis_url: str, tmp_path: Path
) -> None:
    """What a new user met: ``pulse check fabric`` over ``pulse simulate``'s nodes (heartbeats,
    no launcher) waited out the probe timeout and named them slow, SUSPECT for an hour. Their
    heartbeats say they launch nothing, so they are refused by name and left out of a check of
    every node (and of a job's placement). A node whose heartbeats say it launches but whose agent never takes the probe
    (``wedged``: heartbeats written here, no launcher behind them) is not measured: its pair names
    nobody slow, holds nobody SUSPECT, and the check says which nodes it could not measure."""
    s = Stack(tmp_path, PULSE_FABRIC_PROBE_TIMEOUT_S="3", PULSE_FABRIC_PROBE_BYTES=str(1 << 16))
    stop_beats = threading.Event()
    beats = threading.Thread(target=_beat, args=("wedged", stop_beats), daemon=True)
    try:
        s.orchestrator()
        s.procs["sim"] = spawn(
            ["simulate", "--nodes", "2", "--prefix", "nol", "--interval", "0.3"], env=s.env, log=tmp_path / "sim.log"
        )
        s.agent("fab-a")
        beats.start()
        s.wait_healthy(["fab-a", "nol-000", "nol-001", "wedged"])
        # a job our agents would launch is not placed there either (it would never start)
        r = s.post("/v1/jobs", {"name": "j", "nodes": 3, "gpus_per_node": 1, "entrypoint": ["x.py"]})
        assert r.status_code == 409 and "launches nothing): 2 nodes" in r.json()["detail"], r.text
        refused = _check(s, "--nodes", "fab-a,nol-000")
        assert refused.returncode != 0 and "nol-000 launch nothing" in refused.stderr, refused.stderr
        out = _check(s, "--json")  # every node that launches: fab-a and wedged
        assert out.returncode == 3, out.stdout + out.stderr  # 3: nobody slow, somebody not measured
        check = json.loads(out.stdout)
        assert check["nodes"] == ["fab-a", "wedged"] and check["slow"] == [], check
        [pair] = check["pairs"]
        assert pair["state"] == "unmeasured" and "agent of wedged within 3s" in pair["detail"], pair
        assert set(check["unmeasured"]) == {"fab-a", "wedged"} and "not measured" in check["reason"], check
        assert {n: v["state"] for n, v in s.nodes().items()} == dict.fromkeys(
            ["fab-a", "nol-000", "nol-001", "wedged"], "HEALTHY"
        )
        # fab-a's rank of the probe was stopped with the pair: nothing of it left running
        probe = f"job=fabric-{check['id']}-0 node=fab-a state="
        log = tmp_path / "fab-a.log"
        assert f"{probe}started" in log.read_text()  # fab-a's agent took it: the silent one is wedged
        wait_for(lambda: f"{probe}exited" in log.read_text(), timeout=30, what="fab-a's probe rank stopped")
        print(format_fabric_check(check))
    except BaseException:
        print(s.logs())
        raise
    finally:
        stop_beats.set()
        s.close()


def _check(s: Stack, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``pulse check fabric ARGS``, followed for ``timeout`` seconds."""
    return subprocess.run(
        [*PULSE, "check", "fabric", *args, "--timeout", f"{timeout:g}", "--poll", "0.3"],
        check=False,
        env=pulse_env(PULSE_API_URL=s.api, PULSE_API_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout + 30,
    )


def _beat(node: str, stop: threading.Event) -> None:
    """``node``'s heartbeats as an agent with a launcher writes them, every 0.3 s, with nobody
    reading its commands."""
    sim = SimulatedNode(node, gpus=1, seed=1)
    agent = NodeAgent(node=node, gpu=sim, gpu_source="simulated", interval_s=0.3, sim=sim)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        while not stop.wait(0.3):
            write_heartbeat(client, agent)
    finally:
        client.close()
