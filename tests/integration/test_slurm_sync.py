"""Slurm node sync against a real Slurm: munged, slurmctld and 8 ``slurmd -N`` on this machine
(tests/slurm_cluster.py, one cluster for the module), a real ``pulse orchestrator`` with
``PULSE_SLURM=on`` and ``pulse simulate`` agents named like the Slurm nodes (``sn-000`` ...),
with small durations. Skipped where slurm-wlm and munge are not installed (scripts/bootstrap
installs them)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_cluster import SlurmCluster, available
from tests.stack import Stack
from tests.support import spawn, wait_for
from tools.fake_sysfs import FakeSysfs

NODES = [f"sn-{i:03d}" for i in range(8)]
SYNC_S = 0.5  # PULSE_SLURM_SYNC_PERIOD_S
EVALUATE_S = 0.1  # the Stack's PULSE_EVALUATE_INTERVAL_S


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if (why := available()) is not None:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=NODES) as cluster:
        yield cluster


Start = Callable[..., Stack]


@pytest.fixture
def start(slurm: SlurmCluster, redis_url: str, tmp_path: Path) -> Iterator[Start]:
    """``start(nodes, *faults, **env)``: an orchestrator with Slurm sync on this module's Slurm,
    and ``pulse simulate`` with ``nodes`` agents (``sn-000`` ...) and the given faults."""
    slurm.reset()
    stacks: list[Stack] = []

    def run(nodes: int, *faults: str, **env: str) -> Stack:
        settings = {
            "PULSE_SLURM": "on",
            "PULSE_SLURM_CONF": str(slurm.conf),
            "PULSE_SLURM_SYNC_PERIOD_S": str(SYNC_S),
            "PULSE_SLURM_BACKOFF_MAX_S": "1",
            "PULSE_SLURM_COMMAND_TIMEOUT_S": "3",
            "PULSE_RECOVER_AFTER": "2",
            **env,
        }
        stack = Stack(tmp_path, **settings)
        stacks.append(stack)
        stack.orchestrator()
        args = ["simulate", "--nodes", str(nodes), "--prefix", "sn", "--gpus-per-node", "2", "--interval", "0.3"]
        for f in faults:
            args += ["--fault", f]
        stack.procs["simulate"] = spawn(args, env=stack.env, log=tmp_path / "simulate.log")
        return stack

    try:
        yield run
    except BaseException:
        raise
    finally:
        for s in stacks:
            s.close()


@contextlib.contextmanager
def diagnosed(stack: Stack, slurm: SlurmCluster) -> Iterator[None]:
    """On failure, print the orchestrator's and Slurm's logs."""
    try:
        yield
    except BaseException:
        print(stack.logs())
        print(slurm.logs())
        raise


def slurm_events(stack: Stack, node: str | None = None) -> list[dict[str, Any]]:
    return [e for e in stack.events(**({"node": node} if node else {})) if e["kind"].startswith("slurm_")]


def drained(slurm: SlurmCluster) -> dict[str, str]:
    """node -> reason of every node sinfo shows drained or draining."""
    return {n: r for n, (s, r) in slurm.states().items() if s.startswith(("drain", "drng"))}


def test_psu_sag_and_cordon_are_drained_and_resumed_an_admin_drain_never(slurm: SlurmCluster, start: Start) -> None:
    stack = start(8, "sn-002=psu_imbalance@4+5")
    with diagnosed(stack, slurm):
        stack.wait_healthy(NODES, timeout=30)
        slurm.scontrol("update", "NodeName=sn-005", "State=DRAIN", "Reason=maint")

        # sn-002's PSU sags: DEGRADED, then drained in Slurm with our tag and our reason
        wait_for(lambda: stack.nodes()["sn-002"]["state"] == "DEGRADED", timeout=20, what="sn-002 DEGRADED")
        degraded_at = time.monotonic()
        wait_for(lambda: "sn-002" in drained(slurm), timeout=10, what="sinfo showing sn-002 drained")
        took = time.monotonic() - degraded_at
        assert took <= EVALUATE_S + SYNC_S + 1.5, f"drained {took:.2f}s after DEGRADED"
        reason = drained(slurm)["sn-002"]
        assert reason.startswith("clusterpulse: DEGRADED: ") and "PSU current imbalance: PS2" in reason
        # the node shows Slurm's view as of the last sync: ours, from the next one on
        wait_for(
            lambda: stack.get("/v1/nodes/sn-002")["scheduler"]["drained_by_clusterpulse"],
            timeout=5,
            what="sn-002 shown drained by ClusterPulse",
        )
        node = stack.get("/v1/nodes/sn-002")
        assert node["scheduler"]["reason"] == reason and node["scheduler"]["state"] == "idle+drain"
        assert node["schedulable"] is False
        assert stack.metric("pulse_slurm_drained_nodes") == 1

        # the admin's drain shows on our node: not schedulable, Slurm's reason and who set it
        admin = stack.get("/v1/nodes/sn-005")
        assert admin["state"] == "HEALTHY" and admin["schedulable"] is False
        assert admin["scheduler"]["reason"] == "maint" and admin["scheduler"]["reason_set_by"] == "root"
        assert admin["scheduler"]["state"] == "idle+drain" and not admin["scheduler"]["drained_by_clusterpulse"]
        # placement honours it: 7 nodes are there, 6 schedulable (sn-002 DEGRADED, sn-005 drained)
        r = stack.post("/v1/jobs", {"name": "j", "nodes": 7, "gpus_per_node": 1, "entrypoint": ["x.py"]})
        assert r.status_code == 409 and "Slurm idle+drain: maint" in r.json()["detail"], r.text

        # the PSU recovers: HEALTHY after recover_after heartbeats, then resumed
        wait_for(lambda: stack.nodes()["sn-002"]["state"] == "HEALTHY", timeout=20, what="sn-002 HEALTHY again")
        wait_for(lambda: slurm.states()["sn-002"][0] == "idle", timeout=5, what="sn-002 resumed in Slurm")
        assert stack.metric("pulse_slurm_drained_nodes") == 0
        kinds = [(e["kind"], e["actor"]) for e in slurm_events(stack, "sn-002")]
        assert kinds == [("slurm_drain", "slurm"), ("slurm_resume", "slurm")], kinds
        assert all(e["reason"].endswith(": ok") for e in slurm_events(stack, "sn-002"))
        assert "scontrol update NodeName=sn-002 State=DRAIN" in slurm_events(stack, "sn-002")[0]["reason"]

        # an operator's cordon drains, the uncordon resumes
        assert stack.post("/v1/nodes/sn-007/cordon", {"reason": "bad cable"}).status_code == 200
        wait_for(lambda: "sn-007" in drained(slurm), timeout=5, what="cordoned sn-007 drained")
        assert drained(slurm)["sn-007"] == "clusterpulse: cordoned in ClusterPulse"
        assert stack.post("/v1/nodes/sn-007/uncordon").status_code == 200
        wait_for(lambda: slurm.states()["sn-007"][0] == "idle", timeout=5, what="uncordoned sn-007 resumed")
        assert [e["kind"] for e in slurm_events(stack, "sn-007")] == ["slurm_drain_cordon", "slurm_resume"]

        # the admin's drain is still there, never resumed by us; nothing recorded about it
        time.sleep(2 * SYNC_S)
        assert drained(slurm) == {"sn-005": "maint"}
        assert slurm_events(stack, "sn-005") == []


def test_partition_drains_nobody(slurm: SlurmCluster, start: Start) -> None:
    # 5 of 8 agents silent together from t=5 s to 11 s (a partition as the orchestrator sees it
    # from about 5.6 s, past suspect_after) while sn-006's PSU sags from t=7 s: sn-006 goes
    # DEGRADED on its fresh heartbeats, but nothing is drained until the partition ends.
    silent = [f"{n}=silent@5+6" for n in NODES[:5]]
    stack = start(8, *silent, "sn-006=psu_imbalance@7")
    with diagnosed(stack, slurm):
        stack.wait_healthy(NODES, timeout=30)
        wait_for(lambda: stack.metric("pulse_partition_suspected") == 1, timeout=15, what="partition suspected")
        wait_for(lambda: stack.nodes()["sn-006"]["state"] == "DEGRADED", timeout=10, what="sn-006 DEGRADED")
        deadline = time.monotonic() + 4 * SYNC_S
        while time.monotonic() < deadline:
            now_drained = drained(slurm)
            if stack.metric("pulse_partition_suspected") == 0:
                break  # it ended meanwhile: what sinfo said may be from after the end
            assert now_drained == {}, "drained while the partition brake held"
            time.sleep(0.1)
        # the partition ends: the held drain is made, and only that one
        wait_for(lambda: stack.metric("pulse_partition_suspected") == 0, timeout=20, what="partition over")
        wait_for(lambda: "sn-006" in drained(slurm), timeout=10, what="sn-006 drained after the partition")
        time.sleep(2 * SYNC_S)
        assert list(drained(slurm)) == ["sn-006"]
        assert {n: v["state"] for n, v in stack.nodes().items() if n in NODES[:5]} == dict.fromkeys(
            NODES[:5], "HEALTHY"
        )


def test_four_bad_at_once_with_a_quarter_breaker_drains_one_and_survives_a_restart(
    slurm: SlurmCluster, start: Start
) -> None:
    # Our 4 nodes of Slurm's 8; at most 0.25 x 4 = 1 drain per window
    faults = [f"{n}=psu_imbalance@0" for n in NODES[:4]]
    stack = start(4, *faults, PULSE_SLURM_MAX_DRAIN_FRACTION="0.25", PULSE_SLURM_DRAIN_WINDOW_S="600")
    with diagnosed(stack, slurm):
        wait_for(lambda: stack.metric("pulse_slurm_drain_breaker_open") == 1, timeout=30, what="breaker open")
        time.sleep(3 * SYNC_S)
        first = list(drained(slurm))
        assert len(first) == 1, first  # sn-000 unless a sync ran between the nodes' first heartbeats
        assert stack.metric("pulse_slurm_drained_nodes") == 1
        opened = [e for e in slurm_events(stack) if e["kind"] == "slurm_breaker_open"]
        assert len(opened) == 1 and "at most 1 allowed" in opened[0]["reason"], opened
        assert stack.get("/v1/slurm")["breaker_open"] is True

        # SIGKILL the orchestrator: the new one remembers its drain and the open breaker
        os.kill(stack.procs["orch"].pid, signal.SIGKILL)
        stack.procs["orch"].wait(10)
        stack.orchestrator()
        wait_for(lambda: stack.get(f"/v1/nodes/{first[0]}").get("scheduler"), timeout=10, what="a sync after restart")
        assert stack.get(f"/v1/nodes/{first[0]}")["scheduler"]["drained_by_clusterpulse"] is True
        assert stack.metric("pulse_slurm_drain_breaker_open") == 1
        time.sleep(2 * SYNC_S)
        assert list(drained(slurm)) == first

        # an operator resets it: one more drain, and it opens again
        r = stack.post("/v1/slurm/breaker/reset")
        assert r.status_code == 200 and r.json()["changed"] is True, r.text
        wait_for(lambda: len(drained(slurm)) == 2, timeout=10, what="a second drain after the reset")
        wait_for(lambda: stack.metric("pulse_slurm_drain_breaker_open") == 1, timeout=10, what="breaker open again")
        assert len(drained(slurm)) == 2 and first[0] in drained(slurm)
        reset = [e for e in stack.events() if e["kind"] == "slurm_breaker_reset"]
        assert len(reset) == 1 and reset[0]["actor"] == "env"


def test_slurm_down_never_stops_health_and_sync_catches_up(slurm: SlurmCluster, start: Start) -> None:
    stack = start(4, "sn-001=psu_imbalance@10")
    try:
        with diagnosed(stack, slurm):
            stack.wait_healthy(NODES[:4], timeout=30)
            wait_for(lambda: stack.get("/v1/slurm")["last_sync_at"], timeout=10, what="a first sync")
            assert stack.nodes()["sn-001"]["state"] == "HEALTHY"  # its PSU sags once Slurm is down
            slurm.stop_controller()
            # health goes on: the PSU sag is a transition while Slurm does not answer
            wait_for(lambda: stack.nodes()["sn-001"]["state"] == "DEGRADED", timeout=20, what="sn-001 DEGRADED")
            wait_for(
                lambda: stack.metric('pulse_slurm_sync_errors_total{op="sinfo"}') >= 1,
                timeout=15,
                what="sinfo errors counted",
            )
            assert (
                "Unable to contact slurm controller" in stack.get("/v1/slurm")["last_error"]
                or "no answer" in (stack.get("/v1/slurm")["last_error"])
            )
            slurm.start_controller()
            wait_for(lambda: "sn-001" in drained(slurm), timeout=20, what="sn-001 drained once Slurm is back")
            assert drained(slurm)["sn-001"].startswith("clusterpulse: DEGRADED: ")
    finally:
        slurm.reset()


def test_a_port_whose_link_went_down_drains_its_node_with_the_port_in_the_reason(
    slurm: SlurmCluster, start: Start, tmp_path: Path
) -> None:
    """A real ``pulse agent`` on sn-007 reads a fake DGX H100 sysfs tree (PULSE_SYSFS_ROOT,
    tools/fake_sysfs.py): ``link_downed`` +1 on one of its 8 ports degrades it (the other seven
    are up) and drains it in Slurm with that port in the reason (docs/design/fabric.md)."""
    fake = FakeSysfs.dgx_h100(tmp_path / "sn-007-root")
    stack = start(7)  # sn-000 ... sn-006 simulated
    agent_env = {**stack.env, "PULSE_SYSFS_ROOT": str(fake.root)}
    args = ["agent", "--node", "sn-007", "--source", "auto", "--interval", "0.3", "--no-jobs"]
    stack.procs["sn-007"] = spawn(args, env=agent_env, log=tmp_path / "sn-007.log")
    with diagnosed(stack, slurm):
        stack.wait_healthy(NODES, timeout=30)
        assert len(stack.get("/v1/nodes/sn-007")["nics"]) == 8, "the 8 ports are in its heartbeat"
        fake.bump("mlx5_5", "link_downed")
        wait_for(lambda: "sn-007" in drained(slurm), timeout=20, what="sinfo showing sn-007 drained")
        reason = drained(slurm)["sn-007"]
        assert reason.startswith("clusterpulse: DEGRADED: ") and "mlx5_5 port 1: link_downed +1" in reason, reason
        node = stack.get("/v1/nodes/sn-007")
        assert node["state"] == "DEGRADED" and "mlx5_5 port 1: link_downed +1" in node["reason"]


def test_one_bad_gpu_does_not_drain_its_node_and_a_second_one_does(slurm: SlurmCluster, start: Start) -> None:
    """Issue 35: XID 79 on GPU 1 of sn-003 makes it DEGRADED (its GPU 1's rank alone is carried)
    and Slurm is not asked to drain it, the sync saying why; uncorrectable ECC on its GPU 0 too
    makes two bad GPUs, PULSE_SLURM_DRAIN_MIN_BAD_GPUS=2: drained, both named."""
    stack = start(8, "sn-003=xid79:1@6", "sn-003=ecc:0@12")
    with diagnosed(stack, slurm):
        stack.wait_healthy(NODES, timeout=30)
        wait_for(lambda: stack.nodes()["sn-003"]["state"] == "DEGRADED", timeout=20, what="sn-003 DEGRADED")
        assert "GPU 1 fatal XID 79" in stack.nodes()["sn-003"]["reason"]
        wait_for(
            lambda: "not drained for 1 bad GPU(s) of its own" in (stack.tmp / "orch.log").read_text(errors="replace"),
            timeout=10,
            what="the sync saying why it did not drain sn-003",
        )
        assert "sn-003" not in drained(slurm) and slurm_events(stack, "sn-003") == []
        wait_for(lambda: "sn-003" in drained(slurm), timeout=20, what="sn-003 drained for its second bad GPU")
        reason = drained(slurm)["sn-003"]
        assert reason.startswith("clusterpulse: DEGRADED: ") and "GPU 1 fatal XID 79" in reason, reason
        gpus = {g["index"]: g["state"] for g in stack.get("/v1/nodes/sn-003")["gpus"]}
        assert gpus == {0: "DEGRADED", 1: "DEGRADED"}, gpus
