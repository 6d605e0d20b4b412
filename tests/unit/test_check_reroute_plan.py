"""The pure parts of ``pulse check reroute``: rank lists, the check's plan, config validation."""

from __future__ import annotations

import pytest

from tools.check_reroute import CheckConfig, CheckError, after_hang_plan, make_plan, parse_ranks
from trainer.route import parse_plan


def test_parse_ranks() -> None:
    assert parse_ranks("--degrade", "2") == (2,)
    assert parse_ranks("--degrade", " 3, 1") == (3, 1)
    assert parse_ranks("--exclude", None) == ()
    with pytest.raises(CheckError, match=r"--exclude ''"):
        parse_ranks("--exclude", "")


def test_plan_spreads_carriers_nearest_first() -> None:
    plan = make_plan(4, [2], [])
    assert (plan.participants, plan.proxies, plan.excluded) == ([0, 1, 3], {"2": 3}, [])
    plan = make_plan(4, [0, 1], [])
    assert plan.proxies == {"0": 2, "1": 3}  # one each before anyone carries two
    plan = make_plan(6, [0, 1, 2], [5])
    assert plan.proxies == {"0": 3, "1": 4, "2": 3}
    for p in (plan, make_plan(4, [3], [1]), make_plan(2, [0], [])):
        parse_plan(p, len(p.participants) + len(p.proxies) + len(p.excluded))  # a valid plan


def test_after_hang_plan_excludes_the_hung_rank() -> None:
    after = after_hang_plan(make_plan(4, [0, 2], [1]), 2)
    assert (after.generation, after.participants, after.proxies, after.excluded) == (2, [3], {"0": 3}, [1, 2])
    parse_plan(after, 4)


@pytest.mark.parametrize(
    ("cfg", "flag"),
    [
        (CheckConfig(world_size=1, degrade=(0,)), "--world-size"),
        (CheckConfig(degrade=()), "--degrade"),
        (CheckConfig(degrade=(1,), hang=0), "--hang"),
        (CheckConfig(degrade=(1,), bucket_mb=0), "--bucket-mb"),
        (CheckConfig(degrade=(1,), stock_timeout_s=-1), "--stock-timeout"),
        (CheckConfig(degrade=(1,), tolerance=-1), "--tolerance"),
        (CheckConfig(world_size=2, degrade=(1,), exclude=(0,)), "--degrade 1 --exclude 0"),
    ],
)
def test_validate_names_the_flag(cfg: CheckConfig, flag: str) -> None:
    with pytest.raises(CheckError, match=flag):
        cfg.validate()
    CheckConfig(degrade=(1,), exclude=(3,), hang=1).validate()
