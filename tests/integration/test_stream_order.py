"""GET /v1/stream under concurrent commits on PostgreSQL: every event exactly once, in order.

A live orchestrator on PostgreSQL streams while many writers add events at once, each
transaction holding its ids a random while before it commits (so that, with ids drawn from a
sequence, a lower id often commits after a higher one). The stream's reader checks that it got
every event the database holds after its start, each once, ids strictly increasing.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from services import db
from tests.stack import AUTH, live_orchestrator
from tests.support import fresh_database
from tools.sse import Message, parse

pytestmark = pytest.mark.timeout(240)

WRITERS = 8
TRANSACTIONS = 30  # per writer, one to three events each


def _write(url: str, writer: int, stop: threading.Event, errors: list[BaseException]) -> None:
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    rnd = random.Random(writer)
    try:
        for t in range(TRANSACTIONS):
            if stop.is_set():
                return
            with sessions.begin() as s:
                for e in range(rnd.randint(1, 3)):
                    db.record_event(s, kind="order_test", reason=f"writer {writer} tx {t} event {e}", at=time.time())
                s.flush()  # the ids are drawn now; the commit comes a random while later
                time.sleep(rnd.uniform(0, 0.02))
    except BaseException as exc:  # reported by the test, not lost in the thread
        errors.append(exc)
    finally:
        engine.dispose()


def test_the_stream_sends_every_event_once_and_in_order_under_concurrent_commits(tmp_path: Path) -> None:
    with (
        fresh_database("postgresql", tmp_path) as url,
        live_orchestrator(tmp_path, url, gpus=8, PULSE_STREAM_POLL_S="0.005") as stack,
    ):
        got: list[Message] = []
        client = httpx.Client(base_url=stack.api, headers=AUTH, timeout=httpx.Timeout(5.0, read=10.0))
        with client, client.stream("GET", "/v1/stream") as r:
            assert r.status_code == 200, r.read()
            msgs = parse(r.iter_lines())
            start = next(m for m in msgs if m is not None).id
            stop, errors = threading.Event(), []
            writers = [
                threading.Thread(target=_write, args=(url, w, stop, errors), daemon=True) for w in range(WRITERS)
            ]
            for w in writers:
                w.start()
            try:
                for w in writers:
                    w.join(timeout=120)
            finally:
                stop.set()
            assert not errors, errors
            engine = db.make_engine(url)
            try:
                with db.session_factory(engine)() as s:
                    stored = [e.id for e in db.events_after(s, after_id=start, limit=100_000)]
                    written = [e for e in db.events_after(s, after_id=start, limit=100_000) if e.kind == "order_test"]
            finally:
                engine.dispose()
            assert len(written) >= WRITERS * TRANSACTIONS, len(written)
            deadline = time.monotonic() + 30
            for m in msgs:
                if m is not None and m.data is not None:
                    got.append(m)
                    if m.id >= stored[-1]:
                        break
                if time.monotonic() > deadline:
                    break
        ids = [m.id for m in got]
        assert ids == sorted(set(ids)), "repeated or out of order"
        missing = sorted(set(stored) - set(ids))
        assert not missing, f"{len(missing)} of {len(stored)} events never streamed, e.g. {missing[:10]}"
        assert ids == stored
