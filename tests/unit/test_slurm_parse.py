"""Parsing what a real Slurm 22.05 printed (tests/fixtures/slurm/, provenance in its README)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from services.slurm.nodes.loop import SEP, SINFO_ARGS, SlurmClient, SlurmError, parse_sinfo, parse_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def test_idle_cluster() -> None:
    nodes = parse_sinfo((FIXTURES / "sinfo_idle.txt").read_text())
    assert sorted(nodes) == ["sn1", "sn2", "sn3", "sn4"]
    for n in nodes.values():
        assert (n.state, n.flags, n.reason, n.reason_user, n.reason_time) == ("idle", frozenset(), "", "", "")
        assert n.available and not n.drained


def test_drained_down_and_draining() -> None:
    nodes = parse_sinfo((FIXTURES / "sinfo_mixed.txt").read_text())
    sn2, sn3, sn4 = nodes["sn2"], nodes["sn3"], nodes["sn4"]
    assert sn2.state == "idle" and sn2.flags == {"drain"} and sn2.drained and not sn2.available
    assert sn2.reason == ("clusterpulse: DEGRADED: PSU current imbalance: PS2 output 54.1 A vs PS1 66.2 A (bound 8 A)")
    assert sn2.reason_user == "root" and sn2.reason_time.startswith("2026-12-04T")
    assert sn3.state == "down" and sn3.down and not sn3.drained and sn3.reason == "maint: cable swap"
    assert sn4.state_text == "allocated+drain" and sn4.drained and sn4.reason == "maint"
    assert nodes["sn1"].available


def test_state_suffixes_and_flags() -> None:
    assert parse_state("IDLE+DRAIN") == ("idle", frozenset({"drain"}))
    assert parse_state("down*") == ("down", frozenset({"not_responding"}))
    assert parse_state("idle~") == ("idle", frozenset({"powered_down"}))
    assert parse_state("mixed+drain+not_responding") == ("mixed", frozenset({"drain", "not_responding"}))
    assert parse_state("") == ("unknown", frozenset())


def test_a_node_in_two_partitions_is_one_node_and_user_with_uid() -> None:
    line = SEP.join(["sn1", "idle+drain", "maint", "alice(1000)", "2026-12-04T08:00:00", ""])
    nodes = parse_sinfo(f"{line}\n{line}\n")
    assert list(nodes) == ["sn1"] and nodes["sn1"].reason_user == "alice"


def test_a_line_it_cannot_read_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="sn1 idle"):
        parse_sinfo("sn1 idle none\n")


def test_sinfo_args_ask_for_the_parsed_fields() -> None:
    assert SINFO_ARGS[-1] == f"--Format=NodeList:0{SEP},StateComplete:0{SEP},Reason:0{SEP},User:0{SEP},Timestamp:0{SEP}"


def _client(script: str, timeout: float = 5) -> SlurmClient:
    return SlurmClient(sinfo=f"{sys.executable} -c {script!r}", scontrol="scontrol", conf="", timeout_s=timeout)


def test_a_failing_command_is_a_transient_error_with_its_message() -> None:
    msg = (FIXTURES / "sinfo_controller_down.txt").read_text().strip()
    client = _client(f"import sys; sys.stderr.write({msg!r}); sys.exit(1)")
    with pytest.raises(SlurmError, match="exit 1: slurm_load_partitions: Unable to contact") as err:
        asyncio.run(client.nodes())
    assert err.value.op == "sinfo" and err.value.transient


def test_a_command_that_does_not_answer_is_killed_at_the_timeout() -> None:
    client = _client("import time; time.sleep(30)", timeout=0.3)
    with pytest.raises(SlurmError, match=r"no answer within 0\.3s"):
        asyncio.run(client.nodes())


def test_a_missing_command_is_an_error() -> None:
    client = SlurmClient(sinfo="/nonexistent/sinfo", scontrol="scontrol", conf="", timeout_s=1)
    with pytest.raises(SlurmError, match="cannot start"):
        asyncio.run(client.nodes())


def test_conf_goes_to_the_commands_as_slurm_conf() -> None:
    client = SlurmClient(sinfo="sinfo", scontrol="scontrol", conf="/etc/x/slurm.conf", timeout_s=1)
    assert client.env["SLURM_CONF"] == "/etc/x/slurm.conf"
    assert client.drain_argv("sn1", "clusterpulse: a b") == [
        "scontrol", "update", "NodeName=sn1", "State=DRAIN", "Reason=clusterpulse: a b",
    ]  # fmt: skip
