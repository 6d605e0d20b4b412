"""``pulse check reroute`` end to end: the real command, 4 gloo ranks on this machine's CPUs.

Small model and short timeouts so that each run takes seconds; the ranks and the store's port
are the command's own (chosen at run time). Argument errors are checked in-process (``main``)
and once through a subprocess for the exit code.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.support import PULSE, REPO, pulse_env
from tools.cli import main

pytestmark = pytest.mark.timeout(90)

SMALL = ["--hidden", "64", "--layers", "4", "--bucket-mb", "0.01", "--steps", "3", "--repeats", "2", "--timeout", "60"]
PROXY_TIMEOUT_S = 1.0
STOCK_TIMEOUT_S = 3.0
SLACK_S = 3.0  # process scheduling on a small, shared CI box; the step itself is milliseconds


def check(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [*PULSE, "check", "reroute", *args, *SMALL, "--json"],
        env=pulse_env(),
        cwd=REPO,
        capture_output=True,
        check=False,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def assert_exact(out: dict[str, Any], *, live: int) -> None:
    assert out["ok"] is True and out["failures"] == []
    assert out["param_moved"] > 1e-3, "the model did not train: the comparison would be vacuous"
    assert out["max_abs_param_diff"] < 1e-6
    assert out["contributors"] == [live]  # every bucket averaged over every live rank
    assert out["allreduce_buckets"] > 1 and out["ddp_buckets"] > 1
    for key in ("healthy_allreduce_s", "rerouted_allreduce_s", "ratio", "hook_overhead_ratio"):
        assert out[key] > 0, key


def test_hung_degraded_rank_costs_the_proxy_timeout_not_the_stock_timeout() -> None:
    out = check(
        "--world-size",
        "4",
        "--degrade",
        "2",
        "--hang",
        "2",
        "--proxy-timeout",
        str(PROXY_TIMEOUT_S),
        "--stock-timeout",
        str(STOCK_TIMEOUT_S),
    )
    assert out["plan"] == {"participants": [0, 1, 3], "proxies": {"2": 3}, "excluded": []}
    assert_exact(out, live=4)
    assert out["carrier_reported_missing"] == [2]
    assert PROXY_TIMEOUT_S * 0.9 <= out["hung_step_s"] < PROXY_TIMEOUT_S + SLACK_S
    assert out["stock_hung_step_s"] >= STOCK_TIMEOUT_S
    assert "Timed out" in out["stock_hang_error"] or "timeout" in out["stock_hang_error"]
    assert out["after_hang_step_s"] < SLACK_S  # the others carry on without it


def test_degraded_and_excluded_ranks_match_stock_ddp_over_the_survivors() -> None:
    out = check("--world-size", "4", "--degrade", "0", "--exclude", "3")
    assert out["plan"] == {"participants": [1, 2], "proxies": {"0": 1}, "excluded": [3]}
    assert "not excluded" in out["param_diff_reference"]
    assert_exact(out, live=3)
    assert "hung_step_s" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "1", "--degrade", "0"], "--world-size 1: expected at least 2"),
        (["--degrade", "4"], "--degrade 4: rank outside the world 0..3"),
        (["--degrade", "1", "--exclude", "7"], "--exclude 7: rank outside the world 0..3"),
        (["--degrade", "1", "--exclude", "1"], "rank 1 is both degraded and excluded"),
        (["--degrade", "0,1,2,3"], "every rank of the world of 4 is degraded or excluded"),
        (["--degrade", "0,1", "--exclude", "2,3"], "every rank of the world of 4 is degraded or excluded"),
        (["--degrade", "one"], "--degrade 'one': expected RANK[,RANK]"),
        (["--degrade", "1,1"], "rank 1 is listed twice"),
        (["--degrade", "1", "--hang", "2"], "--hang 2: expected one of the degraded ranks 1"),
        (["--degrade", "1", "--steps", "0"], "--steps 0: expected at least 1"),
        (["--degrade", "1", "--proxy-timeout", "0"], "--proxy-timeout 0.0: expected a positive number"),
    ],
)
def test_bad_arguments_name_the_flag(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "reroute", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_arguments_exit_2_from_the_command() -> None:
    proc = subprocess.run(
        [*PULSE, "check", "reroute", "--degrade", "9"],
        env=pulse_env(),
        cwd=REPO,
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--degrade 9: rank outside the world 0..3" in proc.stderr
    assert proc.stdout == ""
