"""Reads at scale through a live orchestrator (real Redis; SQLite and PostgreSQL): the summary and
paging of ``GET /v1/nodes``, and paging of ``GET /v1/events`` (docs/api.md, "Reading in pages").

- The default ``GET /v1/nodes`` is the full form it always was: every node, each as ``GET
  /v1/nodes/{name}`` shows it, ``next`` null.
- Summary pages walked with each answer's ``next`` are every node in name order, with a state
  filter too, each node a few hundred bytes; a cordon shows in the next read.
- Bad ``limit``, ``fields`` or ``after`` are a 422 naming the parameter.
- Event pages walked with ``after`` are the stored events in id order, each once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.stack import AUTH, NODE, live_orchestrator, publish_heartbeat
from tests.support import REDIS_URL, fresh_database, wait_for

pytestmark = pytest.mark.timeout(120)

OTHERS = [f"rd-{i:02d}" for i in (5, 1, 4, 0, 3, 2, 6)]  # published out of order
ALL = sorted([NODE, *OTHERS])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def http(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp: Path = tmp_path_factory.mktemp(request.param)
    with (
        fresh_database(request.param, tmp) as url,
        live_orchestrator(tmp, url, gpus=8) as stack,
        httpx.Client(base_url=stack.api, headers=AUTH, timeout=30) as client,
    ):
        r = redis.Redis.from_url(REDIS_URL)
        for node in OTHERS:
            publish_heartbeat(r, node, gpus=8)
        r.close()
        wait_for(lambda: client.get("/v1/nodes").json()["count"] == len(ALL), timeout=60, what="every node")
        yield client


def _walk(http: httpx.Client, path: str, cursor: str, **params: Any) -> tuple[list[Any], list[int]]:
    """Every item of every page, following ``next``, and each page's count."""
    items: list[Any] = []
    counts: list[int] = []
    after = None
    for _ in range(100):
        r = http.get(path, params={**params, **({cursor: after} if after is not None else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        items += page["data"]
        counts.append(page["count"])
        assert page["count"] == len(page["data"])
        if page["next"] is None:
            return items, counts
        after = page["next"]
    raise AssertionError("no last page")


def test_the_default_list_is_every_node_in_full(http: httpx.Client) -> None:
    r = http.get("/v1/nodes")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["count"] == len(ALL) and body["next"] is None
    assert [n["name"] for n in body["data"]] == ALL
    for n in body["data"]:
        one = http.get(f"/v1/nodes/{n['name']}").json()
        assert set(n) == set(one) and len(n["gpus"]) == 8 and n["psus"] and n["agent"]["gpu_source"] == "simulated"
        moving = ("heartbeat_age_seconds", "last_heartbeat_at", "clock_skew_seconds")
        same = {k: v for k, v in n.items() if k not in moving}
        assert same == {k: v for k, v in one.items() if k not in moving}


def test_summary_pages_are_every_node_in_name_order_and_small(http: httpx.Client) -> None:
    nodes, counts = _walk(http, "/v1/nodes", "after", fields="summary", limit=3)
    assert [n["name"] for n in nodes] == ALL and counts == [3, 3, 2]
    for n in nodes:
        assert len(json.dumps(n, separators=(",", ":"))) <= 400, n
        assert n["gpu"]["count"] == 8 and n["state"] == "HEALTHY" and "gpus" not in n
    healthy, _ = _walk(http, "/v1/nodes", "after", fields="summary", limit=2, state="healthy")
    assert [n["name"] for n in healthy] == ALL
    assert http.get("/v1/nodes", params={"state": "DEGRADED", "limit": 2}).json() == {
        "data": [],
        "count": 0,
        "next": None,
    }
    full, counts = _walk(http, "/v1/nodes", "after", limit=5)  # the full form pages too
    assert [n["name"] for n in full] == ALL and counts == [5, 3] and all(len(n["gpus"]) == 8 for n in full)


def test_a_cordon_shows_in_the_next_summary(http: httpx.Client) -> None:
    victim = OTHERS[0]
    before = http.get("/v1/nodes", params={"fields": "summary", "after": ALL[ALL.index(victim) - 1], "limit": 1})
    assert before.json()["data"][0]["name"] == victim and "cordoned" not in before.json()["data"][0]
    try:
        assert http.post(f"/v1/nodes/{victim}/cordon", json={"reason": "reads"}).status_code == 200
        after = http.get("/v1/nodes", params={"fields": "summary"}).json()["data"]
        shown = next(n for n in after if n["name"] == victim)
        assert shown["cordoned"] is True and shown["schedulable"] is False
        full = next(n for n in http.get("/v1/nodes").json()["data"] if n["name"] == victim)
        assert full["schedulable"] is False
    finally:
        http.post(f"/v1/nodes/{victim}/uncordon")
    back = next(n for n in http.get("/v1/nodes", params={"fields": "summary"}).json()["data"] if n["name"] == victim)
    assert back["schedulable"] is True and "cordoned" not in back


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/v1/nodes", {"limit": "0"}, "limit"),
        ("/v1/nodes", {"limit": "10001"}, "limit"),
        ("/v1/nodes", {"limit": "many"}, "limit"),
        ("/v1/nodes", {"fields": "some"}, "fields"),
        ("/v1/nodes", {"after": "n" * 257}, "after"),
        ("/v1/events", {"after": "-1"}, "after"),
        ("/v1/events", {"after": "last"}, "after"),
    ],
)
def test_a_bad_page_is_a_422_naming_the_parameter(
    http: httpx.Client, path: str, params: dict[str, str], field: str
) -> None:
    r = http.get(path, params=params)
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["detail"]] == [["query", field]], r.text


def test_event_pages_are_the_stored_events_in_id_order(http: httpx.Client) -> None:
    for node in ALL[:4]:  # a few more events: cordons and uncordons
        http.post(f"/v1/nodes/{node}/cordon")
        http.post(f"/v1/nodes/{node}/uncordon")
    stored = http.get("/v1/events", params={"limit": 10_000}).json()
    assert stored["next"] is None and stored["count"] >= 8 + len(ALL)
    ids = sorted(e["id"] for e in stored["data"])
    events, counts = _walk(http, "/v1/events", "after", limit=3, after=0)
    assert [e["id"] for e in events] == ids
    assert all(c == 3 for c in counts[:-1]) and 1 <= counts[-1] <= 3
    assert events == sorted(stored["data"], key=lambda e: e["id"])
    mine, _ = _walk(http, "/v1/events", "after", limit=2, after=0, node=ALL[0])
    assert [e["id"] for e in mine] == [e["id"] for e in events if e["node"] == ALL[0]]
    tail = http.get("/v1/events", params={"after": ids[-2], "limit": 5}).json()
    assert [e["id"] for e in tail["data"]] == ids[-1:] and tail["next"] is None
    # an id past any the table can hold (int4 on PostgreSQL): an empty page, not a database error
    past = http.get("/v1/events", params={"after": 12620070486771092})
    assert past.status_code == 200 and past.json()["data"] == [], past.text
