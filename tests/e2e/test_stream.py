"""End to end: GET /v1/stream against a live orchestrator with simulated agents.

A PSU fault is injected for real (an agent started with ``--fault psu_imbalance@S+D``); the
stream shows the node's DEGRADED transition, the client disconnects, the node recovers while
nobody listens, and a reconnect with ``Last-Event-ID`` delivers the recovery and everything in
between: the messages of both connections are exactly the stored events, in order, none lost or
repeated. ``pulse events --follow`` sees the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.stack import AUTH, Stack
from tests.support import PULSE, REDIS_URL, REPO, free_port, http, spawn, wait_for
from tools.sse import Message, StreamRefused, follow, parse, wake_on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.two_redis]

VICTIM = "st-psu"


def _read_until(
    msgs: Iterator[Message | None], done: Callable[[list[Message]], bool], *, timeout: float, what: str
) -> list[Message]:
    """Messages with data until ``done(messages)``; comments (keepalives) let the deadline be checked."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    for m in msgs:
        if m is not None and m.data is not None:
            got.append(m)
            if done(got):
                return got
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"stream: no {what} within {timeout}s; got {[(m.id, m.event, m.data) for m in got]}")


def _events(stack: Stack) -> list[dict[str, Any]]:
    """GET /v1/events with a token (reads need one here), oldest first."""
    data: list[dict[str, Any]] = stack.get("/v1/events", params={"limit": 10000}, headers=AUTH)["data"]
    return data


def _transition(to: str) -> Callable[[list[Message]], bool]:
    return lambda got: any(
        m.event == "transition" and m.data and m.data["node"] == VICTIM and m.data["to_state"] == to for m in got
    )


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    s = Stack(
        tmp_path,
        PULSE_REDIS_URL=redis_url,
        PULSE_STREAM_POLL_S="0.1",
        PULSE_STREAM_KEEPALIVE_S="0.5",
        PULSE_AUTH_READS="true",
        PULSE_RECOVER_AFTER="2",
    )
    try:
        s.orchestrator()
        yield s
    finally:
        s.close()


def test_stream_follows_a_psu_fault_and_its_recovery_across_a_reconnect(stack: Stack, tmp_path: Path) -> None:
    assert http().get(f"{stack.api}/v1/stream", timeout=5).status_code == 401  # viewer role
    follower_out = tmp_path / "follow.jsonl"
    with follower_out.open("wb") as out:
        follower = subprocess.Popen(
            [*PULSE, "events", "--follow", "--json"],
            env={**stack.env, "PULSE_API_URL": stack.api},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    # what `pulse nodes list --watch` and `pulse jobs show --follow` wait on between refreshes
    woken = wake_on(httpx.Client(base_url=stack.api, headers=AUTH), wanted=lambda e: e["node"] == VICTIM)
    try:
        with httpx.Client(base_url=stack.api, headers=AUTH, timeout=httpx.Timeout(5.0, read=10.0)) as c:
            with c.stream("GET", "/v1/stream") as r:
                assert r.status_code == 200, r.read()
                assert r.headers["content-type"].startswith("text/event-stream")
                msgs = parse(r.iter_lines())
                start = next(m for m in msgs if m is not None).id  # the bare id: where it starts
                stack.agent("st-ok")
                stack.agent(VICTIM, "--fault", "psu_imbalance@3+4")
                first = _read_until(msgs, _transition("DEGRADED"), timeout=60, what=f"{VICTIM} DEGRADED")
            # Disconnected; the node recovers while nobody listens.
            wait_for(
                lambda: any(e["node"] == VICTIM and e["to_state"] == "HEALTHY" for e in _events(stack)),
                timeout=60,
                what=f"{VICTIM} HEALTHY again",
            )
            with c.stream("GET", "/v1/stream", headers={"Last-Event-ID": str(first[-1].id)}) as r:
                second = _read_until(parse(r.iter_lines()), _transition("HEALTHY"), timeout=30, what="the recovery")
        # in id order, the stream's: GET /v1/events lists by time, and on a Cluster two shards' entries
        # are folded out of their agents' order (a lower id can carry a later time)
        stored = sorted((e for e in _events(stack) if e["id"] > start), key=lambda e: e["id"])
        got = first + second
        assert [m.data for m in got] == stored[: len(got)], "lost, repeated or reordered"
        names = {m.data["kind"]: m.event for m in got if m.data}
        assert names.get("health") == "transition" and names.get("registered") == "event", names
        changes = [
            (m.data["from_state"], m.data["to_state"])
            for m in got
            if m.event == "transition" and m.data and m.data["node"] == VICTIM
        ]
        assert changes == [("HEALTHY", "DEGRADED"), ("DEGRADED", "HEALTHY")], changes
        degraded = next(m.data for m in got if m.data and m.data["node"] == VICTIM and m.data["to_state"] == "DEGRADED")
        assert "PSU current imbalance" in degraded["reason"]
        closed = lambda: (tmp_path / "orch.log").read_text().count("event=stream_closed") >= 2  # noqa: E731
        wait_for(closed, timeout=10, what="the orchestrator ending both streams its client left")
        wanted = {m.id for m in got}
        wait_for(
            lambda: wanted <= {json.loads(x)["id"] for x in follower_out.read_text().splitlines() if x.startswith("{")},
            timeout=20,
            what="pulse events --follow printing every streamed event",
        )
        woke: list[Message] = []

        def recovered() -> bool:  # the waker's thread reads the stream at its own pace
            while not woken.empty():
                woke.append(woken.get_nowait())
            return any(m.data and m.event == "transition" and m.data["to_state"] == "HEALTHY" for m in woke)

        wait_for(recovered, timeout=20, what="the recovery in the waker's queue")
        assert [(m.data["from_state"], m.data["to_state"]) for m in woke if m.data and m.event == "transition"] == [
            ("HEALTHY", "DEGRADED"),
            ("DEGRADED", "HEALTHY"),
        ]
        assert all(m.data and m.data["node"] == VICTIM for m in woke)
    finally:
        follower.terminate()
        follower.wait(10)


def test_stream_replays_after_since_id_then_keeps_alive(stack: Stack) -> None:
    # the start's events wait in the outbox until the writer's next flush, after /readyz answers
    wait_for(lambda: _events(stack), timeout=10, what="the orchestrator's start as an event")
    stored = _events(stack)
    got: list[Message] = []
    client = httpx.Client(base_url=stack.api, headers=AUTH, timeout=httpx.Timeout(5.0, read=10.0))
    with client, client.stream("GET", "/v1/stream", params={"since_id": 0}) as r:
        for m in parse(r.iter_lines()):
            if m is None and got:  # the first keepalive after the history
                break
            if m is not None and m.data is not None:
                got.append(m)
    assert [m.data for m in got][: len(stored)] == stored


def _closing(lines: list[str]) -> list[Message]:
    """The ``closed`` messages among the stream's lines."""
    return [m for m in parse(lines) if m is not None and m.event == "closed"]


REFUSED = {"status": 401, "detail": "the bearer token is unknown or revoked; this call needs role viewer or above"}


def test_a_revoked_tokens_stream_ends_saying_why(stack: Stack) -> None:
    """A viewer token's stream is open; the token is revoked: the stream ends with a ``closed``
    message naming the refusal (not at the client's leisure), and reconnecting with it is a 401."""
    created = stack.post("/v1/tokens", {"name": "stream-viewer", "role": "viewer"})
    assert created.status_code == 201, created.text
    viewer = {"Authorization": f"Bearer {created.json()['secret']}"}
    lines: list[str] = []
    client = httpx.Client(base_url=stack.api, headers=viewer, timeout=httpx.Timeout(5.0, read=10.0))
    with client, client.stream("GET", "/v1/stream") as r:
        assert r.status_code == 200
        revoked_at = None
        for line in r.iter_lines():  # ends when the server closes the stream
            lines.append(line)
            if line.startswith(": keepalive") and revoked_at is None:  # streaming: now revoke it
                revoked = stack.post("/v1/tokens/stream-viewer/revoke")
                assert revoked.json()["changed"] is True, revoked.text
                lines.append("revoked")
                revoked_at = time.monotonic()
            if revoked_at is not None and time.monotonic() - revoked_at > 10:
                break  # keepalives went on: the stream outlived its token
    closing = _closing(lines)
    assert [m.data for m in closing] == [REFUSED], lines
    assert lines.index("revoked") < lines.index("event: closed") and lines[-1] == "", lines
    assert http().get(f"{stack.api}/v1/stream", headers=viewer, timeout=5).status_code == 401


def test_a_token_revoked_on_another_replica_ends_its_stream_within_a_second(tmp_path: Path) -> None:
    """Two replicas on one database; a viewer streams from the first and its token is revoked
    through the second, whose revoke the first's token cache (kept long here) does not see: the
    stream still ends within PULSE_STREAM_TOKEN_CHECK_S (1 s) with a ``closed`` message, its id the
    last one sent, and the follower of tools/sse.py stops on it with the reason."""
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    s = Stack(tmp_path, PULSE_STREAM_POLL_S="0.1", PULSE_AUTH_READS="true", PULSE_TOKEN_CACHE_S="60")
    try:
        s.orchestrator()
        other = free_port()
        s.procs["orch-b"] = spawn(
            ["orchestrator", "--port", str(other)], env={**s.env, "PULSE_REPLICA_ID": "orch-b"}, log=tmp_path / "b.log"
        )
        wait_for(
            lambda: http().get(f"http://127.0.0.1:{other}/readyz", timeout=1).status_code == 200,
            timeout=30,
            what="the second replica ready",
        )
        created = s.post("/v1/tokens", {"name": "far-viewer", "role": "viewer"})
        assert created.status_code == 201, created.text
        viewer = {"Authorization": f"Bearer {created.json()['secret']}"}
        lines: list[str] = []
        client = httpx.Client(base_url=s.api, headers=viewer, timeout=httpx.Timeout(5.0, read=10.0))
        with client, client.stream("GET", "/v1/stream") as stream:
            assert stream.status_code == 200
            lines_in = stream.iter_lines()
            while not (line := next(lines_in)).startswith("id:"):  # connected: where it starts
                lines.append(line)
            start = int(line.removeprefix("id:"))
            revoked = http().post(f"http://127.0.0.1:{other}/v1/tokens/far-viewer/revoke", headers=AUTH, timeout=10)
            assert revoked.status_code == 200 and revoked.json()["changed"] is True, revoked.text
            revoked_at = time.monotonic()
            lines += list(lines_in)  # until the server ends the stream
            took = time.monotonic() - revoked_at
        closing = _closing(lines)
        assert [m.data for m in closing] == [REFUSED], lines
        assert closing[0].id >= start
        # one check interval, plus the lookup and a loaded machine's scheduling
        assert took < 1.5, f"the stream outlived its revoked token by {took:.2f}s"
        with pytest.raises(StreamRefused, match="401"):
            next(follow(httpx.Client(base_url=s.api, headers=viewer)))
    finally:
        s.close()


def test_the_follower_stops_on_a_closed_message() -> None:
    """tools/sse.py: a ``closed`` message ends :func:`follow` with the reason, not a reconnect."""
    body = ': connected\nid: 7\n\nid: 8\nevent: event\ndata: {"id": 8}\n\n'
    body += 'id: 8\nevent: closed\ndata: {"status": 401, "detail": "revoked"}\n\n'
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=body))
    got = follow(httpx.Client(transport=transport, base_url="http://pulse.test"))
    assert next(got).data == {"id": 8}
    with pytest.raises(StreamRefused, match="closed -> 401: revoked"):
        next(got)


def test_sigterm_ends_every_stream_and_the_orchestrator_stops(tmp_path: Path) -> None:
    """uvicorn waits for every open response before the app's lifespan ends, and a stream never
    ends by itself: a SIGTERMed orchestrator with one viewer (the status page) never stopped, nor
    wrote its last outbox, nor gave up its lease. Now the stream ends first (its client reconnects
    where it was) and the orchestrator stops, well inside a grace of 120 s that would otherwise
    cancel it (services/api/server.py)."""
    redis.Redis.from_url(REDIS_URL).flushdb()  # no lease of an earlier test's orchestrator
    s = Stack(tmp_path, PULSE_REDIS_URL=REDIS_URL, PULSE_SHUTDOWN_GRACE_S="120")
    try:
        s.orchestrator()
        orch = s.procs["orch"]
        client = httpx.Client(base_url=s.api, timeout=httpx.Timeout(5.0, read=30.0))
        with client, client.stream("GET", "/v1/stream") as r:
            lines = r.iter_lines()
            assert next(lines) == ": connected"
            orch.terminate()
            rest = list(lines)  # ends when the server closes it; a read timeout fails the test
        assert not [line for line in rest if line.startswith("data:")], rest
        assert orch.wait(30) == -signal.SIGTERM  # uvicorn raises the signal again once it has stopped
        log = (tmp_path / "orch.log").read_text()
        assert "event=stream_closed" in log and "why='server stopping'" in log, log[-2000:]
        assert "event=leader_released" in log, log[-2000:]
    finally:
        s.close()
