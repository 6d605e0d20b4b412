"""The ACL rule builder and the sender check, as pure functions."""

from __future__ import annotations

import hashlib

import pytest

from clusterpulse import acl, wire
from services.ingest.decide import SenderCheck


def _hb(node: str = "n1", boot_id: str = "b1", seq: int = 5, **kw: object) -> wire.Heartbeat:
    return wire.Heartbeat(
        v=wire.PROTOCOL_VERSION, node=node, boot_id=boot_id, seq=seq, sent_at=0.0, interval_s=1.0,
        gpu_source="none", **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_node_rules_grant_its_own_keys_and_its_shard_only() -> None:
    rules = acl.node_acl("gpu-a.r1_7", shards=8, password="pw")
    shard = wire.heartbeat_shard("gpu-a.r1_7", 8)
    assert rules[:4] == ["pulse-node-gpu-a.r1_7", "reset", "on", "#" + hashlib.sha256(b"pw").hexdigest()]
    assert "pw" not in rules  # only the hash travels
    assert "(+set %W~pulse:{node:gpu-a.r1_7}:latest)" in rules
    xadd = next(r for r in rules if r.startswith("(+xadd"))
    assert f"%W~{wire.heartbeat_stream_key(shard)}" in xadd
    others = [wire.heartbeat_stream_key(s) for s in range(8) if s != shard]
    assert not any(o in xadd for o in others)
    assert "%W~pulse:{jobs}:status" in xadd and "%W~pulse:{trainer}:reports" in xadd
    assert "(+xread %R~pulse:{node:gpu-a.r1_7}:commands)" in rules
    assert "(+xread +xrevrange %R~pulse:{job:*}:commands)" in rules  # a Slurm job's ranks' supervisors
    assert "(+get %R~pulse:{job:*}:plan)" in rules
    assert "&pulse:plans" in rules
    assert not any(r in rules for r in ("allkeys", "~*", "+@all", "allchannels"))


def test_shards_follow_the_setting() -> None:
    for shards in (1, 2, 16):
        xadd = next(r for r in acl.node_acl("n7", shards=shards, password="p") if r.startswith("(+xadd"))
        assert wire.node_heartbeat_stream_key("n7", shards) in xadd


@pytest.mark.parametrize("bad", ["", "a*", "a?", "a[1]", "a\\b", "-lead", "sp ace", "x" * 64, "a}b"])
def test_invalid_node_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="expected a name matching"):
        acl.node_acl(bad, shards=1, password="p")
    with pytest.raises(ValueError, match="node="):
        acl.node_username(bad)


def test_glob_escape_and_key_globs() -> None:
    assert wire.glob_escape("a*b?c[d]e\\f{g}") == "a\\*b\\?c\\[d\\]e\\\\f{g}"
    assert wire.key_glob(wire.node_latest_key) == "pulse:{node:*}:latest"
    assert wire.key_glob(wire.heartbeat_stream_key) == "pulse:{hb:*}:stream"
    assert wire.key_glob(wire.job_plan_key) == "pulse:{job:*}:plan"


def test_orchestrator_rules_cover_what_it_reads_and_writes() -> None:
    rules = acl.orchestrator_acl(password="pw")
    assert rules[0] == acl.ORCHESTRATOR_USER and "+time" in rules and "+publish" in rules
    group = next(r for r in rules if r.startswith("(+xreadgroup"))
    for stream in ("~pulse:{hb:*}:stream", "~pulse:{trainer}:reports", "~pulse:{jobs}:status"):
        assert stream in group
    assert "(+get %R~pulse:{node:*}:latest)" in rules
    assert "(+xadd %W~pulse:{node:*}:commands %W~pulse:{job:*}:commands)" in rules  # a Slurm job's too
    assert "(+xtrim +xlen +xrange ~pulse:{node:*}:commands ~pulse:{job:*}:commands)" in rules  # the trimming
    assert acl.orchestrator_acl(password="pw", user="other")[0] == "other"
    with pytest.raises(ValueError, match="password"):
        acl.orchestrator_acl(password="")


def test_credentials_url_keeps_scheme_host_db_and_query() -> None:
    url = acl.credentials_url(
        "rediss://old:secret@redis.example:6380/3?ssl_ca_certs=/etc/pulse/ca.pem",
        username="pulse-node-n1",
        password="p/w",
    )
    assert url == "rediss://pulse-node-n1:p%2Fw@redis.example:6380/3?ssl_ca_certs=/etc/pulse/ca.pem"
    assert acl.credentials_url("redis://[::1]:7000/0", username="u", password="p") == "redis://u:p@[::1]:7000/0"


def test_redis_cli_line_quotes_selectors() -> None:
    line = acl.redis_cli_line(["u", "on", "(+get ~a)", 'x"y'])
    assert line == 'ACL SETUSER u on "(+get ~a)" "x\\"y"'


def test_sender_check_judges_an_entry_by_its_nodes_own_key() -> None:
    def verdict(hb: wire.Heartbeat, own: bytes | None) -> str | None:
        return SenderCheck().verdict(hb, wire.encode(hb), own)  # nothing remembered

    own = _hb(seq=5)
    own_bytes = wire.encode(own)
    assert verdict(own, own_bytes) is None  # the entry is the node's latest
    assert verdict(_hb(seq=4), own_bytes) is None  # a backlog entry of the same boot
    assert verdict(_hb(seq=5, labels={"rack": "forged"}), own_bytes) == "sender"  # same seq, other bytes
    assert verdict(_hb(seq=6), own_bytes) == "sender"  # its node never wrote it
    assert verdict(_hb(boot_id="forged", seq=1), own_bytes) == "sender"
    assert verdict(_hb(seq=4), None) == "sender"  # no evidence at all
    assert verdict(_hb(seq=4), b"{not json") == "sender"
    # The node's own key names another node: its writer claims a node it is not.
    assert verdict(_hb(seq=4), wire.encode(_hb(node="n2", seq=9))) == "sender"


def test_sender_check_remembers_what_a_key_held() -> None:
    """Once the key held seq 5, entries 1-5 of that boot need no read; seq 6 does, and a forged
    seq 5 (other bytes) never passes; a new boot's key starts a new memory."""
    check = SenderCheck()
    five = _hb(seq=5)
    assert not check.vouched(_hb(seq=3), wire.encode(_hb(seq=3)))
    assert check.verdict(_hb(seq=3), wire.encode(_hb(seq=3)), wire.encode(five)) is None
    for seq in (1, 4):
        assert check.vouched(_hb(seq=seq), wire.encode(_hb(seq=seq)))
    assert check.vouched(five, wire.encode(five))
    forged = _hb(seq=5, labels={"rack": "forged"})
    assert not check.vouched(forged, wire.encode(forged))
    assert check.verdict(forged, wire.encode(forged), None) == "sender"  # the key expired meanwhile
    six = _hb(seq=6)
    assert not check.vouched(six, wire.encode(six))
    assert check.verdict(six, wire.encode(six), wire.encode(five)) == "sender"  # the key still says 5
    assert check.verdict(six, wire.encode(six), wire.encode(six)) is None
    assert not check.vouched(_hb(boot_id="other", seq=1), wire.encode(_hb(boot_id="other", seq=1)))
    rebooted = _hb(boot_id="new", seq=2)
    assert (
        check.verdict(_hb(boot_id="new", seq=1), wire.encode(_hb(boot_id="new", seq=1)), wire.encode(rebooted)) is None
    )
    assert check.vouched(_hb(boot_id="new", seq=1), wire.encode(_hb(boot_id="new", seq=1)))
