"""The API's contract against its behaviour, one test per finding of the outside schemathesis
run (issue #20, item 7), through the real app (its lifespan, real Redis, SQLite and PostgreSQL):

- ``Idempotency-Key`` empty, blank or over 128 characters: 422 naming the header, every time
  (an empty key used to be stored, and the second one broke the unique constraint: a 500);
- ``gpus_per_node: 0``: 422 naming the field, nothing stored;
- a key reused with another body: 409 naming the key; with the same body: 200 and the same
  job, as the schema documents;
- the schema's security says which routes need a token in each mode (see
  ``services/api/openapi.py document``), and the app does what it says;
- every 405 carries ``Allow`` with every method of the path.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clusterpulse.settings import load_settings
from services.api.app import create_app
from tests.stack import AUTH, TOKEN, live_orchestrator
from tests.support import REDIS_URL, fresh_database

pytestmark = pytest.mark.timeout(120)

JOB = {"name": "ac", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["train.py"]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def http(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A live orchestrator on a fresh database, called as the bootstrap admin."""
    tmp = tmp_path_factory.mktemp(request.param)
    with (
        fresh_database(request.param, tmp) as url,
        live_orchestrator(tmp, url, gpus=64) as stack,
        httpx.Client(base_url=stack.api, headers=AUTH, timeout=30) as client,
    ):
        yield client


def job_count(http: httpx.Client) -> int:
    count: int = http.get("/v1/jobs").json()["count"]
    return count


def names_header(response: httpx.Response) -> bool:
    return any(e["loc"] == ["header", "idempotency-key"] for e in response.json()["detail"])


@pytest.mark.parametrize("key", ["", "a b", "k" * 129, "clé"], ids=["empty", "inner-space", "129", "non-ascii"])
def test_a_bad_idempotency_key_is_a_422_naming_the_header_every_time(http: httpx.Client, key: str) -> None:
    before = job_count(http)
    for _ in range(2):  # the second empty key was the 500 (unique constraint on jobs.idempotency_key)
        r = http.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": key.encode("utf-8")})
        assert r.status_code == 422, r.text
        assert names_header(r), r.text
    assert job_count(http) == before


@pytest.mark.parametrize("value", [b" ", b"\t \t"], ids=["space", "tabs"])
def test_a_blank_idempotency_key_is_a_422_too(http: httpx.Client, value: bytes) -> None:
    """HTTP strips the blanks around a header value, so a blank key arrives empty. httpx will not
    send one, curl will: a raw request."""
    body = json.dumps(JOB).encode()
    host, port = http.base_url.host, http.base_url.port
    assert port is not None
    request = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key:%s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
    ) % (host.encode(), TOKEN.encode(), value, len(body), body)
    for _ in range(2):
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 422"), reply[:300]
        assert b'"loc":["header","idempotency-key"]' in payload, payload[:300]


def test_a_key_of_128_visible_characters_is_taken(http: httpx.Client) -> None:
    key = "K" * 127 + "~"
    first = http.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    http.post(f"/v1/jobs/{first.json()['id']}/stop")


def test_gpus_per_node_zero_is_a_422_naming_the_field_and_nothing_is_stored(http: httpx.Client) -> None:
    before = job_count(http)
    r = http.post("/v1/jobs", json={**JOB, "gpus_per_node": 0})
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "gpus_per_node"]], r.text
    assert "greater than or equal to 1" in r.text
    assert job_count(http) == before
    field = http.get("/openapi.json").json()["components"]["schemas"]["JobCreate"]["properties"]["gpus_per_node"]
    assert field["minimum"] == 1, field


def test_a_reused_key_replays_the_same_body_and_refuses_another(http: httpx.Client) -> None:
    key = {"Idempotency-Key": "ci-run-4711"}
    first = http.post("/v1/jobs", json=JOB, headers=key)
    assert first.status_code == 201, first.text
    job_id = first.json()["id"]

    again = http.post("/v1/jobs", json=JOB, headers=key)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == job_id

    other = http.post("/v1/jobs", json={**JOB, "gpus_per_node": 2}, headers=key)
    assert other.status_code == 409, other.text
    detail = other.json()["detail"]
    assert "ci-run-4711" in detail and job_id in detail and "gpus_per_node" in detail, detail
    assert job_count(http) == len({j["id"] for j in http.get("/v1/jobs").json()["data"]})

    responses = http.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"200", "201", "409", "422"} <= set(responses), sorted(responses)
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobPublic"}
    http.post(f"/v1/jobs/{job_id}/stop")


def test_a_known_job_without_a_plan_is_a_409_and_an_unknown_one_a_404(http: httpx.Client) -> None:
    """The live run's stateful phase created a job and read its plan: a 404 said the job it had
    just created was not there."""
    job = http.post("/v1/jobs", json=JOB)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    r = http.get(f"/v1/jobs/{job_id}/plan")
    assert r.status_code == 409, r.text
    assert job_id in r.json()["detail"] and "no plan yet" in r.json()["detail"], r.text
    assert http.get("/v1/jobs/nosuchjob/plan").status_code == 404
    assert "409" in http.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/plan"]["get"]["responses"]
    http.post(f"/v1/jobs/{job_id}/stop")


# --- the schema's auth, per mode (no lifespan needed: the schema is built from settings) -----
READS = ("/v1/nodes", "/v1/jobs", "/v1/events")
PROBES = ("/healthz", "/readyz")


def security(settings: dict[str, Any]) -> dict[tuple[str, str], Any]:
    schema = create_app(load_settings(redis_url=REDIS_URL, **settings)).openapi()
    return {(m.upper(), p): op.get("security") for p, ops in schema["paths"].items() for m, op in ops.items()}


BEARER = [{"HTTPBearer": []}]
OPTIONAL = [{"HTTPBearer": []}, {}]


@pytest.mark.parametrize(
    ("mode", "settings", "expected"),
    [
        ("development", {"api_token": TOKEN}, (None, None, None, BEARER)),
        ("development-open", {}, (None, None, None, OPTIONAL)),
        ("production", {"env": "production", "api_token": TOKEN}, (BEARER, None, None, BEARER)),
        (
            "everything-protected",
            {"api_token": TOKEN, "auth_reads": True, "auth_metrics": True, "auth_health": True},
            (BEARER, BEARER, BEARER, BEARER),
        ),
    ],
)
def test_the_schema_says_which_routes_need_a_token_in_each_mode(
    mode: str, settings: dict[str, Any], expected: tuple[Any, Any, Any, Any]
) -> None:
    """Reads, /metrics, probes, then mutations and admin routes: None is no security at all."""
    reads, metrics, probes, writes = expected
    sec = security(settings)
    for path in READS:
        assert sec[("GET", path)] == reads, (mode, path)
    assert sec[("GET", "/metrics")] == metrics, mode
    for path in PROBES:
        assert sec[("GET", path)] == probes, (mode, path)
    for key, value in sec.items():
        if key[0] == "POST" or key[1].startswith(("/v1/tokens", "/v1/settings")):
            assert value == writes, (mode, key)


def test_open_reads_are_served_without_a_token_and_writes_are_not(http: httpx.Client) -> None:
    """Development with a bootstrap token: what the schema leaves without security is served to
    a caller without a token, what it protects is refused with 401."""
    schema = http.get("/openapi.json").json()
    with httpx.Client(base_url=http.base_url, timeout=30) as bare:
        _served_as_the_schema_says(bare, schema)


def _served_as_the_schema_says(bare: httpx.Client, schema: dict[str, Any]) -> None:
    for path, ops in schema["paths"].items():
        if "{" in path:
            continue
        for method, op in ops.items():
            with bare.stream(method.upper(), path) as r:  # only the head: GET /v1/stream never ends
                code = r.status_code
                body = r.read().decode() if code != 200 else ""
            if op.get("security"):
                assert code == 401, (method, path, code)
                assert "401" in op["responses"], (method, path)
            else:
                assert code == 200, (method, path, code, body)
                assert "401" not in op["responses"], (method, path)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/jobs", "GET, POST"),
        ("DELETE", "/v1/tokens", "GET, POST"),
        ("OPTIONS", "/v1/jobs", "GET, POST"),
        ("POST", "/v1/nodes", "GET"),
        ("DELETE", "/v1/jobs/abc", "GET"),
        ("GET", "/v1/jobs/abc/stop", "POST"),
        ("PATCH", "/healthz", "GET"),
    ],
)
def test_every_405_allows_every_method_of_its_path(http: httpx.Client, method: str, path: str, allow: str) -> None:
    r = http.request(method, path)
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == allow


def test_slurm_off_says_so_and_the_breaker_reset_is_a_409(http: httpx.Client) -> None:
    assert http.get("/v1/slurm").json() == {**http.get("/v1/slurm").json(), "enabled": False}
    r = http.post("/v1/slurm/breaker/reset")
    assert r.status_code == 409 and "PULSE_SLURM" in r.json()["detail"], r.text
    node = http.get("/v1/nodes").json()["data"][0]
    assert node["scheduler"] is None and node["schedulable"] is True


def test_a_slurm_job_on_an_orchestrator_without_slurm_is_a_409_naming_the_backend(http: httpx.Client) -> None:
    before = job_count(http)
    r = http.post("/v1/jobs", json={**JOB, "backend": "slurm"})
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith("backend 'slurm': Slurm is off on this orchestrator (PULSE_SLURM=on"), r.text
    assert job_count(http) == before
    bad = http.post("/v1/jobs", json={**JOB, "backend": "pbs"})
    assert bad.status_code == 422 and [e["loc"] for e in bad.json()["detail"]] == [["body", "backend"]], bad.text
    ok = http.post("/v1/jobs", json=JOB)  # no backend: the orchestrator's default, the agents
    assert ok.status_code == 201 and ok.json()["backend"] == "agents" and ok.json()["slurm_job_id"] is None, ok.text
    http.post(f"/v1/jobs/{ok.json()['id']}/stop")


@pytest.mark.parametrize(("query", "field"), [("shards=0", "shards"), ("shard=-1", "shard"), ("shards=257", "shards")])
def test_a_split_scrape_out_of_range_is_a_422_naming_the_parameter(http: httpx.Client, query: str, field: str) -> None:
    r = http.get(f"/metrics?{query}")
    assert r.status_code == 422, r.text
    assert any(e["loc"] == ["query", field] for e in r.json()["detail"]), r.text


def test_a_part_beyond_the_split_is_a_404_naming_it(http: httpx.Client) -> None:
    """Valid each on its own, so not a 422: no such part (a scrape target set up wrong is down)."""
    r = http.get("/metrics?shard=4&shards=4")
    assert r.status_code == 404, r.text
    assert "shard=4" in r.json()["detail"] and "shards=4" in r.json()["detail"]


def test_the_parts_of_a_split_scrape_are_the_whole(http: httpx.Client) -> None:
    """Every node's series in exactly one part, the cluster-wide ones in part 0 only. (The stack
    is shared by this module's tests, which start jobs: only the nodes' series are compared.)"""
    whole = http.get("/metrics")
    parts = [http.get(f"/metrics?shard={k}&shards=3") for k in range(3)]
    assert whole.status_code == 200 and all(p.status_code == 200 for p in parts)
    assert "pulse_leader" in parts[0].text and all("pulse_leader" not in p.text for p in parts[1:])
    assert "pulse_nodes{" in parts[0].text and all("pulse_nodes{" not in p.text for p in parts[1:])

    def node_series(text: str) -> list[str]:  # the series, values aside (ages move between requests)
        return [line.rsplit(" ", 1)[0] for line in text.splitlines() if 'node="' in line and not line.startswith("#")]

    union = [s for p in parts for s in node_series(p.text)]
    assert union and len(union) == len(set(union))
    assert set(union) == set(node_series(whole.text))
