"""Reading the orchestrator's event stream (``GET /v1/stream``, services/api/routes/stream.py):
Server-Sent Events parsed from lines, and a follower that reconnects with ``Last-Event-ID``.
Used by ``pulse events --follow`` and the tests."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Message:
    """One SSE message: ``id``, ``event`` (the message name) and ``data`` (the event's JSON);
    ``data`` None: a bare ``id:`` (the stream says where it starts, so a reconnect resumes there)."""

    id: int
    event: str
    data: dict[str, Any] | None


def parse(lines: Iterable[str]) -> Iterator[Message | None]:
    """Messages from the lines of an event stream; ``None`` for each comment (``: keepalive``),
    so that a reader sees that the stream is alive. Fields other than id/event/data are ignored."""
    fields: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            yield None
            continue
        if line == "":
            if "data" in fields or "id" in fields:
                data = json.loads(fields["data"]) if "data" in fields else None
                yield Message(int(fields.get("id", "0")), fields.get("event", "message"), data)
            fields = {}
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        fields[name] = fields[name] + "\n" + value if name == "data" and name in fields else value


CLOSED = "closed"  # the last message of a stream whose token no longer admits it (data: status, detail)


class StreamRefused(Exception):
    """The orchestrator answered the stream request with an error status (401, 403, ...), or
    ended the stream with a ``closed`` message (the token was revoked meanwhile)."""


def follow(
    client: httpx.Client,
    *,
    since_id: int | None = None,
    read_timeout_s: float = 60.0,
    reconnect_s: float = 1.0,
    on_reconnect: Callable[[Exception], None] | None = None,
) -> Iterator[Message]:
    """Every message of the stream, for ever: after ``since_id`` (None: after the newest event at
    the first connection); a dropped connection is reopened with ``Last-Event-ID`` set to the last
    id seen, so nothing is lost or repeated. An error status, or a ``closed`` message, raises
    :class:`StreamRefused`."""
    last = since_id
    while True:
        headers = {"Last-Event-ID": str(last)} if last is not None else {}
        try:
            with client.stream(
                "GET", "/v1/stream", headers=headers, timeout=httpx.Timeout(10.0, read=read_timeout_s)
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    raise StreamRefused(f"GET /v1/stream -> {r.status_code}: {r.text}")
                for msg in parse(r.iter_lines()):
                    if msg is not None and msg.event == CLOSED and msg.data is not None:
                        raise StreamRefused(f"GET /v1/stream closed -> {msg.data['status']}: {msg.data['detail']}")
                    if msg is not None:
                        last = msg.id
                        if msg.data is not None:
                            yield msg
        except httpx.TransportError as exc:
            if on_reconnect is not None:
                on_reconnect(exc)
        time.sleep(reconnect_s)


def wake_on(client: httpx.Client, *, wanted: Callable[[dict[str, Any]], bool]) -> queue.Queue[Message]:
    """A queue that receives, from a daemon thread following the stream from now on, every message
    whose event ``wanted`` accepts: a loop that waits on it with a timeout acts at once on a change
    and still refreshes what events do not carry (heartbeat ages, a job's step) at its own pace.
    A stream that refuses (401, 403) ends the thread; the loop then only refreshes."""
    woken: queue.Queue[Message] = queue.Queue()

    def run() -> None:
        with contextlib.suppress(StreamRefused):
            for msg in follow(client):
                if msg.data is not None and wanted(msg.data):
                    woken.put(msg)

    threading.Thread(target=run, name="pulse-stream", daemon=True).start()
    return woken
