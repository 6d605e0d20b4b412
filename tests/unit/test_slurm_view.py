"""What people see of the Slurm sync: /metrics lines, placement refusals, `pulse nodes list`."""

from __future__ import annotations

from typing import Any

from clusterpulse.settings import load_settings
from services.jobs.placement import NodeCapacity, PlacementRefusal, PlacementRequest, place
from services.slurm.nodes.decide import Breaker, Drain
from services.slurm.nodes.loop import SlurmClient, SlurmSync, metric_lines
from tools.format import format_nodes


async def _no_write(fn: Any) -> Any:
    raise AssertionError("nothing is stored here")


def test_metric_families_are_typed_always_and_sampled_when_on() -> None:
    off = metric_lines(None)
    assert [line for line in off if not line.startswith("#")] == []
    assert "# TYPE pulse_slurm_sync_errors_total counter" in off
    client = SlurmClient(sinfo="sinfo", scontrol="scontrol", conf="", timeout_s=1)
    sync = SlurmSync(load_settings(slurm=True), client, cluster=lambda: None, write=_no_write)
    sync.memory = {"sn-1": Drain("clusterpulse: x", 1.0)}
    sync.breaker = Breaker(open=True, since=2.0, reason="r")
    sync.errors["sinfo"] += 3
    on = metric_lines(sync)
    for line in (
        "pulse_slurm_drained_nodes 1",
        'pulse_slurm_sync_errors_total{op="sinfo"} 3',
        'pulse_slurm_sync_errors_total{op="drain"} 0',
        "pulse_slurm_drain_breaker_open 1",
    ):
        assert line in on


def test_placement_skips_a_node_slurm_keeps_out_and_names_it() -> None:
    nodes = [
        NodeCapacity("a", "HEALTHY", True, 8),
        NodeCapacity("b", "HEALTHY", True, 8, blocked="Slurm idle+drain: maint"),
    ]
    assert place(nodes, PlacementRequest(nodes=1, gpus_per_node=1)).nodes == ("a",)  # type: ignore[union-attr]
    refused = place(nodes, PlacementRequest(nodes=2, gpus_per_node=1))
    assert isinstance(refused, PlacementRefusal) and "Slurm idle+drain: maint: 1 node" in refused.reason


def node(name: str, schedulable: bool, scheduler: dict[str, Any] | None) -> dict[str, Any]:
    return {"name": name, "state": "HEALTHY", "schedulable": schedulable, "heartbeat_age_seconds": 0.1,
            "gpus": [], "psus": [], "reason": "ok", "scheduler": scheduler}  # fmt: skip


def sched(state: str, reason: str = "", by: str = "", ours: bool = False) -> dict[str, Any]:
    return {"state": state, "available": "drain" not in state, "reason": reason, "reason_set_by": by,
            "reason_set_at": "", "drained_by_clusterpulse": ours}  # fmt: skip


def test_nodes_list_shows_slurm_beside_ours() -> None:
    out = format_nodes(
        [
            node("sn-1", True, sched("idle")),
            node("sn-2", False, sched("idle+drain", "clusterpulse: DEGRADED: x", "root", ours=True)),
            node("sn-3", False, sched("idle+drain", "maint", "root")),
            node("sn-4", False, sched("idle")),
        ]
    ).splitlines()
    assert out[0].split()[:4] == ["NODE", "STATE", "SLURM", "SCHED"]
    assert "idle+drain (ours)" in out[2] and "slurm" in out[2]
    assert "idle+drain (root: maint)" in out[3]
    assert out[4].split()[2:4] == ["idle", "cordoned"]
    assert "SLURM" not in format_nodes([node("x", True, None)])
