"""GET /v1/nodes as services/api/bodies.py serves it, on a snapshot built by hand (no I/O):

- the full form is, value for value, what ``NodePublic`` (the pydantic model) makes of a node;
- pages in name order, each ``after`` the last's ``next``, are the whole list, with or without a
  state filter; ``next`` is null on the last page;
- a node's JSON is built once per change of the node: asking again builds nothing, a heartbeat,
  a transition or a cordon builds that node's again, a new snapshot builds everything again, and
  the heartbeat age moves with the clock without building anything;
- the summary of a node with 8 GPUs and 8 network ports is under 400 bytes and names its worst GPU.
"""

from __future__ import annotations

import json

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from services.api.bodies import NodeBodies
from services.api.routes.nodes import node_public
from services.api.schemas import NodeSummaryPublic
from services.cluster import Cluster
from services.health import decide as health

NAMES = ["n03", "n00", "n02", "n01", "n04"]
LABELS = {"nvlink_domain": "nvl-000", "switch": "sw-000", "rack": "rack-000"}


def _agent(name: str, gpus: int = 8) -> NodeAgent:
    sim = SimulatedNode(name, gpus=gpus, seed=len(name))
    return NodeAgent(node=name, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim, labels=LABELS)


def _cluster(at: float = 100.0) -> tuple[Cluster, dict[str, NodeAgent]]:
    c = Cluster(policy=health.Policy(), grace_start=0.0)
    agents = {n: _agent(n) for n in NAMES}
    for a in agents.values():
        _beat(c, a, at)
    return c, agents


def _beat(c: Cluster, a: NodeAgent, at: float) -> None:
    assert a.sim is not None
    c.ingest(wire.encode(a.heartbeat(a.sim.sample())), received_at=at)


def _page(bodies: NodeBodies, c: Cluster, now: float = 101.0, **kw: object) -> dict[str, object]:
    out: dict[str, object] = json.loads(bodies.page(c, now=now, **kw))  # type: ignore[arg-type]
    return out


def test_the_full_form_is_what_node_public_makes_of_each_node_in_name_order() -> None:
    c, _ = _cluster()
    c.restore(name="n05", state="DEGRADED", since=5.0, reason="silent", last_seen=None, schedulable=False,
              labels={}, telemetry={})  # fmt: skip
    got = _page(NodeBodies(), c, fields="full")
    want = [json.loads(node_public(c.nodes[n], now=101.0).model_dump_json()) for n in sorted(c.nodes)]
    assert got == {"data": want, "count": 6, "next": None}
    assert [n["heartbeat_age_seconds"] for n in want] == [1.0] * 5 + [None]


def test_pages_after_each_next_are_the_whole_list_with_and_without_a_state_filter() -> None:
    c, _ = _cluster()
    c.set_schedulable("n02", False)
    c.nodes["n03"].health = health.NodeHealth(name="n03", state=health.NodeState.DEGRADED, last_seen=100.0)
    bodies = NodeBodies()
    for fields in ("full", "summary"):
        for state, want in ((None, sorted(NAMES)), ("HEALTHY", ["n00", "n01", "n02", "n04"])):
            names, after, pages = [], None, []
            while True:
                p = _page(bodies, c, fields=fields, state=state, limit=2, after=after)
                pages.append(p["count"])
                names += [n["name"] for n in p["data"]]  # type: ignore[attr-defined]
                if p["next"] is None:
                    break
                after = p["next"]
            assert names == want, (fields, state)
            assert pages == [2, 2, 1] if state is None else [2, 2], pages
    assert _page(bodies, c, fields="summary", after="n01a")["data"][0]["name"] == "n02"  # type: ignore[index]
    assert _page(bodies, c, fields="summary", after="zzz") == {"data": [], "count": 0, "next": None}
    one = _page(bodies, c, fields="summary", limit=1, after="n03")
    assert one["count"] == 1 and one["next"] is None  # exactly the last node: no page follows


def test_a_node_is_built_once_per_change_and_its_age_moves_without_building() -> None:
    c, agents = _cluster()
    bodies = NodeBodies()
    first = _page(bodies, c, fields="summary")
    assert bodies.built == 5
    again = _page(bodies, c, fields="summary", now=103.5)
    assert bodies.built == 5  # nothing changed: nothing built
    assert [n["heartbeat_age_seconds"] for n in again["data"]] == [3.5] * 5  # type: ignore[attr-defined]
    assert [dict(n, heartbeat_age_seconds=0) for n in again["data"]] == [  # type: ignore[attr-defined]
        dict(n, heartbeat_age_seconds=0)
        for n in first["data"]  # type: ignore[attr-defined]
    ]
    _beat(c, agents["n01"], 104.0)  # a heartbeat
    assert _page(bodies, c, fields="summary", now=104.0)["data"][1]["heartbeat_age_seconds"] == 0.0  # type: ignore[index]
    assert bodies.built == 6
    c.set_schedulable("n04", False)  # a cordon
    assert _page(bodies, c, fields="summary", state="HEALTHY", after="n03")["data"][0]["cordoned"] is True  # type: ignore[index]
    assert bodies.built == 7
    moved, _ = c.evaluate(now=100.0 + 3600)  # silence: every node's transition
    assert len(moved) == 5
    assert {n["state"] for n in _page(bodies, c, fields="summary", now=3700.0)["data"]} == {"SUSPECT"}  # type: ignore[attr-defined]
    assert bodies.built == 12
    _page(bodies, c, fields="full")  # the other form is built on its own
    assert bodies.built == 17
    fresh, _ = _cluster()  # a take-over's snapshot: the same names, other views
    _page(bodies, fresh, fields="summary")
    assert bodies.built == 22


def test_the_summary_is_small_and_names_the_worst_gpu() -> None:
    c, _ = _cluster()
    view = c.nodes["n00"]
    assert view.latest is not None and len(view.latest.nics) == 8 and len(view.latest.gpus) == 8
    body = NodeBodies().page(c, now=101.0, fields="summary", limit=1)
    one = json.loads(body)["data"][0]
    assert len(json.dumps(one, separators=(",", ":"))) <= 400, one
    NodeSummaryPublic.model_validate(one)
    gpus = view.latest.gpus
    gpu = one["gpu"]
    assert gpu["count"] == 8 and "lost" not in gpu and "cordoned" not in one
    assert gpu["temperature_max_celsius"] == round(max(g.temperature_celsius or 0 for g in gpus), 1)
    assert gpu["power_min_watts"] == round(min(g.power_watts for g in gpus if g.power_watts is not None), 1)
    assert gpu["power_max_watts"] == round(max(g.power_watts for g in gpus if g.power_watts is not None), 1)
    assert set(one["psu_amperes"]) == {p.name for p in view.latest.psus}
    assert one["labels"] == LABELS


def test_the_summary_names_what_is_wrong_with_a_gpu() -> None:
    c, agents = _cluster()
    sim = agents["n02"].sim
    assert sim is not None
    sim.faults |= {"gpu_lost", "pcie_x8", "xid", "thermal"}
    _beat(c, agents["n02"], 102.0)
    shown = json.loads(NodeBodies().page(c, now=102.0, fields="summary", after="n01", limit=1))["data"][0]
    hb = c.nodes["n02"].latest
    assert hb is not None
    lost = [g.index for g in hb.gpus if g.lost]
    narrow = [[g.index, g.pcie_link_width, g.pcie_link_width_max] for g in hb.gpus if not g.lost and g.pcie_link_width
              and g.pcie_link_width_max and g.pcie_link_width < g.pcie_link_width_max]  # fmt: skip
    assert lost and narrow
    gpu = shown["gpu"]
    assert (
        gpu["lost"] == len(lost)
        and gpu["pcie_narrow"] == narrow
        and gpu["pcie_width_min"] == min(w for _, w, _ in narrow)
    )
    assert gpu["xids_recent"] == sorted({x for g in hb.gpus for x in g.xids_recent}) != []
    assert gpu["throttle"] == ["thermal"]
    assert len(json.dumps(shown, separators=(",", ":"))) <= 400 + len(shown["reason"]), shown
