"""Schemathesis against the orchestrator's own OpenAPI schema, in process (ASGI) with its real
lifespan: real Redis (database ``PULSE_TEST_REDIS_DB``) and SQLite in a temporary folder.

Every operation of the schema, with inputs that fit it (positive) and inputs that break it
(negative), as the bootstrap admin (so that auth does not hide the handlers) and without a
token. Every route is protected here (reads, /metrics and probes too), so that "accepted
without a token" means something. What must hold for every request:

- no 5xx (``not_a_server_error``);
- the status, content type, headers and body are the ones the schema documents
  (``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``): every refusal is in /docs;
- input that breaks the schema is refused with a 4xx (``negative_data_rejection``), input that
  fits it is not refused as invalid (``positive_data_acceptance``): the schema is the validation;
- a request without its token is refused (``ignored_auth``, ``missing_required_header``);
- and every other check schemathesis registers (``--checks all``: ``unsupported_method``,
  ``allow_header_conformance``, ``use_after_free``, ``ensure_resource_availability``,
  ``object_level_authorization``), read off its registry.

Then the routes whose path names a thing run again with names that exist (a node that sent a
heartbeat, a job placed on it, a stored token), so that 404 does not hide their handlers.
Rate limiting is off here (it would hide handlers behind 429); tests/integration/test_ratelimit.py
covers it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CHECKS as REGISTERED
from schemathesis.python import asgi

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.settings import load_settings
from services import db
from services.api.app import create_app
from tests.support import REDIS_URL, wait_for

pytestmark = pytest.mark.timeout(240)

ADMIN = "bootstrap-token-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
NODE = "st-node-1"
# Per operation, mode and caller (about 2,000 requests in all); raise it for a deeper run.
EXAMPLES = int(os.environ.get("PULSE_SCHEMATHESIS_EXAMPLES", "30"))
# Every check schemathesis has (``--checks all``), read off its registry so that a new one joins.
CHECKS = REGISTERED.get_all()

# A body over PULSE_MAX_BODY_BYTES is refused with 413 before it is read: a rejection too.
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [
                    "400",
                    "401",
                    "403",
                    "404",
                    "405",
                    "406",
                    "409",
                    "413",
                    "415",
                    "422",
                    "428",
                    "429",
                ]
            }
        }
    }
)


# An endless response (Server-Sent Events) cannot be validated as a whole; its own test
# (tests/e2e/test_stream.py) covers its refusals and its messages.
ENDLESS = {"/v1/stream"}


@dataclass
class Api:
    schema: schemathesis.BaseSchema
    existing: dict[str, str]  # path parameter -> a value that names something that exists


def _publish_heartbeat(client: redis.Redis) -> None:
    sim = SimulatedNode(NODE, gpus=8, seed=1)
    agent = NodeAgent(node=NODE, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    payload = wire.encode(agent.heartbeat(sim.sample()))
    client.set(wire.node_latest_key(NODE), payload, ex=600)
    client.xadd(wire.heartbeat_stream_key(0), {wire.HEARTBEAT_FIELD: payload})


def _stored_check(path: Path) -> str:
    """A finished fabric check in the database (one node alone cannot start one over the API)."""
    eng = db.make_engine(f"sqlite:///{path}")
    with db.session_factory(eng).begin() as s:
        pair = {"round": 1, "nodes": [NODE, "st-other"], "state": "done", "busbw_gbps": 1.0, "detail": ""}
        row = db.create_fabric_check(s, check_id="st-check", nodes=[NODE, "st-other"], pairs=[pair], at=1.0, actor="st")
        db.update_fabric_check(s, row=row, pairs=[pair], reason="done", at=2.0, slow={}, median_gbps=1.0)
    eng.dispose()
    return "st-check"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    tmp: Path = tmp_path_factory.mktemp("schemathesis")
    app = create_app(
        load_settings(
            redis_url=REDIS_URL,
            database_url=f"sqlite:///{tmp / 'pulse.db'}",
            api_token=ADMIN,
            auth_reads=True,
            auth_metrics=True,
            auth_health=True,
            rate_limit_per_s=0,
            heartbeat_interval_s=1.0,
            degraded_after_s=600.0,
            lost_after_s=1200.0,
            recover_after=1,
        ),
        consumer="schemathesis",
    )
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)  # starts the lifespan
        _publish_heartbeat(client)
        with asgi.get_client(app) as http:
            wait_for(
                lambda: http.get(f"/v1/nodes/{NODE}", headers=AUTH).json().get("state") == "HEALTHY",
                timeout=60,
                what=f"{NODE} HEALTHY",
            )
            job = http.post(
                "/v1/jobs", json={"name": "st", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["x.py"]}, headers=AUTH
            )
            assert job.status_code == 201, job.text
            token = http.post("/v1/tokens", json={"name": "st-viewer", "role": "viewer"}, headers=AUTH)
            assert token.status_code == 201, token.text
        yield Api(schema, {"name": NODE, "job_id": job.json()["id"], "check_id": _stored_check(tmp / "pulse.db")})
    finally:
        asgi.shutdown_lifespans()
        client.flushdb()
        client.close()


def _fuzz(op: Any, *, mode: str, headers: dict[str, str] | None, examples: int, **fixed: Any) -> int:
    """Run ``examples`` generated cases of ``op`` through every check; returns how many ran."""
    ran = 0

    @given(op.as_strategy(schemathesis.GenerationMode(mode), headers=headers, **fixed))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        nonlocal ran
        ran += 1
        case.call_and_validate(checks=CHECKS, headers=headers)  # the token is the caller's, not generated

    run()
    return ran


def _nothing_to_break(op: Any) -> bool:
    """An operation with no query parameter and no body: with its token fixed, there is no
    schema-violating input to make (path parameters are free strings)."""
    raw = op.definition.raw
    return "requestBody" not in raw and not any(p.get("in") == "query" for p in raw.get("parameters", []))


def _run_all(api: Api, run: Callable[[Any], int], *, negative: bool, fixed_auth: bool) -> None:
    failures: dict[str, str] = {}
    ran: dict[str, int] = {}
    for result in api.schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        if op.path in ENDLESS:
            continue
        try:
            ran[label] = run(op)
        except Unsatisfiable:
            if not (negative and fixed_auth and _nothing_to_break(op)):
                raise
            ran[label] = 0
        except (Exception, BaseExceptionGroup) as exc:  # every operation runs; all failures are reported
            failures[label] = str(exc)[:4000]  # a generated body can be 300 kB
    assert not failures, "\n\n".join(f"=== {k}\n{v}" for k, v in failures.items())
    assert len(ran) >= 17, ran  # every route of the API, none filtered out
    assert all(n > 0 for k, n in ran.items() if not negative), ran


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("caller", ["admin", "no-token"])
def test_every_operation_conforms_and_never_fails(api: Api, mode: str, caller: str) -> None:
    headers = AUTH if caller == "admin" else None
    t0 = time.monotonic()
    _run_all(
        api,
        lambda op: _fuzz(op, mode=mode, headers=headers, examples=EXAMPLES),
        negative=mode == "negative",
        fixed_auth=headers is not None,
    )
    print(f"{caller} {mode}: {time.monotonic() - t0:.1f}s")


def test_named_things_that_exist(api: Api) -> None:
    """Cordon/uncordon, a GPU reset, job read/plan/stop/checkpoint, a fabric check and token revoke
    on names that exist, as admin."""
    ran = {}
    for result in api.schema.get_all_operations():
        op = result.ok()
        params = {p["name"] for p in op.definition.raw.get("parameters", []) if p.get("in") == "path"}
        if not params:
            continue
        existing = {p: api.existing.get(p, "st-viewer") for p in params}
        if op.path.startswith("/v1/tokens/"):
            existing = {"name": "st-viewer"}
        ran[f"{op.method.upper()} {op.path}"] = _fuzz(
            op, mode="positive", headers=AUTH, examples=EXAMPLES // 2, path_parameters=existing
        )
    assert len(ran) == 10 and all(ran.values()), ran
