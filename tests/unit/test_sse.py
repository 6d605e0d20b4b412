"""The event stream's messages as the server writes them and as tools/sse.py reads them back."""

from __future__ import annotations

from services.api.routes.stream import format_message, message_name
from tools.sse import Message, parse


def test_each_kind_has_its_message_name() -> None:
    assert [message_name(k) for k in ("health", "plan", "job", "registered", "cordon", "slurm_drain")] == [
        "transition",
        "plan",
        "job",
        "event",
        "event",
        "event",
    ]


def test_messages_round_trip_with_comments_and_a_bare_id() -> None:
    events = [
        {"id": 7, "kind": "health", "node": "n1", "reason": "PSU current imbalance: a\nb"},
        {"id": 9, "kind": "plan", "node": None, "reason": ""},
    ]
    text = ": connected\nid: 6\n\n" + "".join(format_message(e) for e in events) + ": keepalive\n\n"
    got = list(parse(text.split("\n")))
    assert got == [
        None,
        Message(6, "message", None),
        Message(7, "transition", events[0]),
        Message(9, "plan", events[1]),
        None,
    ]
