"""The job lifecycle decision, through every state and its guards."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping

from clusterpulse.states import TERMINAL_JOB_STATES
from clusterpulse.wire import REJOIN_REFUSED_EXIT
from services.jobs.decide import JobDecision, decide, master_addr, master_port, rejoinable

NODES = ["a", "b"]
BOTH = (0, 1)  # every rank of a 2-node job, 1 rank a node
RDV = "a:29512"


def d(  # type: ignore[no-untyped-def]
    state: str, status: dict[str, dict[str, object]], *, since: float = 0.0, now: float = 1.0, joined=BOTH
):
    return decide(
        state=state, nodes=NODES, status=status, since=since, now=now, start_timeout=60.0,
        joined=joined, gpus_per_node=1, rendezvous=RDV,
    )  # fmt: skip


def started() -> dict[str, object]:
    return {"state": "started"}


def exited(code: int, tail: str = "") -> dict[str, object]:
    return {"state": "exited", "exit_code": code, "log_tail": tail}


def test_pending_launches_and_starting_resends_until_every_node_answers() -> None:
    assert d("PENDING", {}).state == "STARTING" and d("PENDING", {}).send == "launch"
    r = d("STARTING", {"a": started()})
    assert (r.state, r.send) == ("STARTING", "launch")
    r = d("STARTING", {"a": started(), "b": started()})
    assert (r.state, r.send, r.reason) == ("RUNNING", None, "every rank rendezvoused at a:29512: 2 ranks on a, b")


def test_a_job_waiting_for_its_preflight_stays_pending_and_launches_nothing() -> None:
    held = "waiting for its fabric preflight"
    kw = {
        "nodes": NODES,
        "status": {},
        "since": 0.0,
        "now": 1e6,
        "start_timeout": 60.0,
        "joined": (),
        "gpus_per_node": 1,
    }
    assert decide(state="PENDING", rendezvous=RDV, held=held, **kw) == JobDecision("PENDING", held)  # type: ignore[arg-type]
    assert decide(state="PENDING", rendezvous=RDV, **kw).send == "launch"  # type: ignore[arg-type]


def test_running_means_every_rank_rendezvoused_not_that_the_agents_started_them() -> None:
    both = {"a": started(), "b": started()}
    for joined in ((), (0,), (1,), (1, 5), (-1, 0)):  # ranks outside the world are no one's
        r = d("STARTING", both, joined=joined)
        assert (r.state, r.send, r.reason) == ("STARTING", None, ""), joined  # launched everywhere: no resend
    assert d("STARTING", {"a": started()}, joined=BOTH).state == "STARTING"  # b's agent has not answered
    assert d("STARTING", {"a": exited(0), "b": started()}, joined=BOTH).state == "RUNNING"  # a finished early
    assert d("STARTING", both, joined=(1, 0, 0)).state == "RUNNING"


def test_ranks_that_never_rendezvous_fail_the_job_at_the_start_timeout_naming_the_address() -> None:
    both = {"a": started(), "b": started()}
    assert d("STARTING", both, joined=(0,), since=0.0, now=60.0).state == "STARTING"  # not yet
    r = d("STARTING", both, joined=(0,), since=0.0, now=60.5)
    assert (r.state, r.send) == ("FAILED", "stop")  # the ranks still retrying are stopped
    assert r.reason == (
        "ranks did not rendezvous within 60 s at a:29512: 1 of 2 ranks registered or reported a step; waiting on b"
    )
    r = d("STARTING", both, joined=(), since=0.0, now=61.0)
    assert r.reason.endswith("0 of 2 ranks registered or reported a step; waiting on a, b")
    assert d("RUNNING", both, joined=(), since=0.0, now=1e6).state == "RUNNING"  # only a start is timed


def test_several_ranks_a_node_each_count() -> None:
    def g(joined: Collection[int], now: float = 1.0) -> JobDecision:
        return decide(
            state="STARTING", nodes=["x", "y", "z"], status=dict.fromkeys("xyz", started()), since=0.0, now=now,
            start_timeout=10.0, joined=joined, gpus_per_node=4, rendezvous="[fd00::1]:29600",
        )  # fmt: skip

    assert g(range(12)).state == "RUNNING"
    assert g(range(11)).state == "STARTING"
    r = g([0, 1, 2, 3, 8, 9, 10, 11], now=11.0)
    assert r.reason == (
        "ranks did not rendezvous within 10 s at [fd00::1]:29600: 8 of 12 ranks registered or reported a step; "
        "waiting on y"
    )
    zero = decide(
        state="STARTING", nodes=NODES, status={"a": started(), "b": started()}, since=0.0, now=1.0,
        start_timeout=10.0, joined=BOTH, gpus_per_node=0, rendezvous=RDV,
    )  # fmt: skip
    assert zero.state == "RUNNING"  # no GPUs: one rank a node, as the agents launch it


def test_master_addr_label_then_published_then_name() -> None:
    assert master_addr("bar-j1", "10.0.0.9", "10.1.1.1") == "10.0.0.9"  # the operator's label wins
    assert master_addr("bar-j1", None, "10.1.1.1") == "10.1.1.1"  # what the agent found
    assert master_addr("bar-j1", "", "") == "bar-j1"  # an agent that publishes no address


def test_success_needs_every_node_to_exit_zero() -> None:
    assert d("RUNNING", {"a": exited(0), "b": started()}).state == "RUNNING"
    assert d("RUNNING", {"a": exited(0), "b": exited(0)}).state == "SUCCEEDED"
    assert d("STARTING", {"a": exited(0), "b": exited(0)}).state == "SUCCEEDED"  # a very short job


def test_failures_stop_the_others_and_say_why() -> None:
    r = d("RUNNING", {"a": exited(3, "step 4\nCUDA error: out of memory\n"), "b": started()})
    assert (r.state, r.send) == ("FAILED", "stop")
    assert r.reason == "ranks on a exited with 3; last log line: CUDA error: out of memory"
    r = d("STARTING", {"a": {"state": "preflight_failed", "detail": "GPU 3 lost"}})
    assert (r.state, r.reason) == ("FAILED", "preflight failed on a: GPU 3 lost")
    assert d("RUNNING", {"a": {"state": "lost", "detail": "x"}, "b": started()}).state == "FAILED"
    r = d("STARTING", {"a": started()}, since=0.0, now=61.0)
    assert (r.state, r.reason) == ("FAILED", "no start from b within 60s")


def test_stopping_until_every_rank_is_gone_and_terminal_states_stay() -> None:
    r = d("STOPPING", {"a": started(), "b": exited(143)})
    assert (r.state, r.send) == ("STOPPING", "stop")
    assert d("STOPPING", {"a": exited(143), "b": exited(143)}).state == "STOPPED"
    assert d("STOPPING", {}).state == "STOPPED"  # never launched
    for state in ("SUCCEEDED", "FAILED", "STOPPED"):
        r = d(state, {"a": started()})
        assert (r.state, r.send) == (state, None)


def test_decisions_are_level_triggered() -> None:
    status = {"a": started(), "b": started()}
    first = d("STARTING", status)
    assert d(first.state, status).state == first.state == "RUNNING"


def test_master_port_is_stable_and_in_range() -> None:
    assert master_port("abc") == master_port("abc")
    assert all(29500 <= (master_port(str(i)) or 0) < 30000 for i in range(1000))
    assert all(31000 <= (master_port(str(i), base=31000, span=7) or 0) < 31007 for i in range(100))


def test_master_port_skips_the_ports_active_jobs_at_the_address_hold() -> None:
    """Two jobs at one address on one port would share one store (services/jobs/decide.py)."""
    own = master_port("abc", base=100, span=5)
    assert own is not None
    assert master_port("abc", taken={own}, base=100, span=5) == 100 + (own - 100 + 1) % 5  # the next one up
    last = 104
    wrapped = master_port("abc", taken=set(range(100, 105)) - {100}, base=100, span=5)
    assert (
        wrapped == 100 and master_port("abc", taken={p for p in range(100, 105) if p != last}, span=5, base=100) == last
    )
    assert master_port("abc", taken=set(range(100, 105)), base=100, span=5) is None


def test_a_node_whose_ranks_the_plan_excluded_no_longer_counts_once_running() -> None:
    def x(state: str, status: dict[str, dict[str, object]]):  # type: ignore[no-untyped-def]
        return decide(
            state=state, nodes=NODES, status=status, since=0.0, now=1.0, start_timeout=60.0,
            joined=BOTH, gpus_per_node=1, rendezvous=RDV, excluded={"b"},
        )  # fmt: skip

    assert x("RUNNING", {"a": started(), "b": exited(-9)}).state == "RUNNING"  # the survivors train on
    assert x("RUNNING", {"a": started(), "b": {"state": "lost"}}).state == "RUNNING"
    done = x("RUNNING", {"a": exited(0), "b": started()})
    assert done.state == "SUCCEEDED"  # a hung excluded rank is not waited for,
    assert done.send == "stop"  # it is stopped, with the job's store
    assert x("RUNNING", {"a": exited(1), "b": exited(0)}).state == "FAILED"  # a survivor failing still fails it
    r = x("STARTING", {"a": started(), "b": exited(-9)})
    assert r.state == "FAILED"  # before RUNNING nothing is excluded: a failed start is a failure


def test_an_excluded_node_whose_ranks_are_gone_is_relaunched_to_rejoin_once_healthy() -> None:
    def x(status: dict[str, dict[str, object]], **kw: object):  # type: ignore[no-untyped-def]
        args: dict[str, object] = {"excluded": {"b"}, "healthy": {"b"}, "max_rejoins": 3, **kw}
        return decide(
            state="RUNNING", nodes=NODES, status=status, since=0.0, now=1.0, start_timeout=60.0,
            joined=BOTH, gpus_per_node=1, rendezvous=RDV, **args,  # type: ignore[arg-type]
        )  # fmt: skip

    assert x({"a": started(), "b": exited(-9)}).relaunch == ("b",)  # killed
    assert x({"a": started(), "b": exited(0)}).relaunch == ("b",)  # woke up excluded and left
    assert x({"a": started(), "b": {"state": "lost"}}).relaunch == ("b",)  # died while its agent was away
    assert x({"a": started(), "b": started()}).relaunch == ()  # still running (hung, or relaunched already)
    assert x({"a": started(), "b": exited(-9)}, healthy=set()).relaunch == ()  # its node is not HEALTHY yet
    assert x({"a": started(), "b": exited(-9)}, rejoins={"b": 3}).relaunch == ()  # relaunched often enough
    assert x({"a": started(), "b": exited(-9)}, max_rejoins=0).relaunch == ()  # rejoin off
    assert x({"a": started(), "b": exited(-9)}, rejoin=False).relaunch == ()  # ZeRO 3: the job goes on without it
    assert x({"a": started(), "b": exited(-9)}, excluded=set()).state == "FAILED"  # not excluded: a failure
    done = x({"a": exited(0), "b": exited(-9)})
    assert done.state == "SUCCEEDED" and done.relaunch == ()  # nothing to rejoin once the others are done


def test_a_zero_3_job_is_not_rejoinable() -> None:
    assert rejoinable(None) and rejoinable({}) and rejoinable({"zero_optimization": {"stage": 0}})
    assert rejoinable({"zero_optimization": {}})  # DeepSpeed's default stage is 0
    assert rejoinable({"zero_optimization": {"stage": 1}}) and rejoinable({"zero_optimization": {"stage": 2}})
    assert not rejoinable({"zero_optimization": {"stage": 3}})


NODE_STATUSES: list[Mapping[str, object] | None] = [
    None, started(), exited(0), exited(1), exited(143), {"state": "lost"}, {"state": "preflight_failed"},
]  # fmt: skip


def test_starting_over_every_mix_of_answers_joins_and_times() -> None:
    """Every mix of node answers (1-3 nodes), ranks a node, joined ranks and elapsed time: RUNNING
    only with every rank joined and every node answered; a timeout only past the start timeout,
    naming the rendezvous; FAILED always stops the ranks; a decision taken again on its own result
    stays where it is (level-triggered)."""
    cases = 0
    for nodes, gpus in itertools.product((1, 2, 3), (0, 1, 2)):
        names = [f"n{i}" for i in range(nodes)]
        world = nodes * max(1, gpus)
        everyone = set(range(world))
        joins = [set(), everyone, everyone - {world - 1}, {0}, everyone | {world, -1}]
        for statuses, joined, elapsed in itertools.product(
            itertools.product(NODE_STATUSES, repeat=nodes), joins, (0.0, 60.0, 60.001)
        ):
            cases += 1
            status = {n: s for n, s in zip(names, statuses, strict=True) if s is not None}

            def run(state: str) -> JobDecision:
                return decide(
                    state=state, nodes=names, status=status, since=100.0, now=100.0 + elapsed,  # noqa: B023
                    start_timeout=60.0, joined=joined, gpus_per_node=gpus, rendezvous="h:1",  # noqa: B023
                )  # fmt: skip

            r = run("STARTING")
            answered = all(status.get(n, {}).get("state") in ("started", "exited") for n in names)
            assert r.state in ("STARTING", "RUNNING", "FAILED", "SUCCEEDED")
            if r.state == "RUNNING":
                assert answered and everyone <= joined and r.send is None
            elif r.state == "STARTING":
                assert elapsed <= 60.0 and not (answered and everyone <= joined)
                assert r.send == (None if answered else "launch")
            elif r.state == "FAILED":
                assert r.send == "stop" and r.reason
                if "rendezvous" in r.reason or "no start" in r.reason:
                    assert elapsed > 60.0 and "within 60" in r.reason
                if "rendezvous" in r.reason:
                    assert answered and "at h:1" in r.reason and not everyone <= joined
            else:
                assert all(status[n]["state"] == "exited" for n in names)
            again = run(r.state)
            if r.state in TERMINAL_JOB_STATES:
                assert (again.state, again.send) == (r.state, None)
            else:
                assert again.state == r.state
    assert cases > 5000


def _with_exits(status: dict[str, dict[str, object]], exits: dict[int, int], *, per_node: int = 2) -> JobDecision:
    return decide(
        state="RUNNING", nodes=NODES, status=status, since=0.0, now=1.0, start_timeout=60.0,
        joined=range(2 * per_node), gpus_per_node=per_node, rendezvous=RDV, exits=exits,
    )  # fmt: skip


def test_a_node_whose_ranks_all_reported_their_exit_counts_as_exited_whatever_its_agent_said() -> None:
    # node b's agent died while its ranks ran: it last said "started", and was then lost
    for b in (started(), {"state": "lost", "detail": "node LOST"}):
        r = _with_exits({"a": exited(0), "b": b}, {2: 0, 3: 0})
        assert (r.state, r.send) == ("SUCCEEDED", "stop")
        r = _with_exits({"a": exited(0), "b": b}, {2: 0, 3: 1})
        assert r.state == "FAILED" and "ranks on b exited with 1" in r.reason
    # one rank of b has not said how it ended: b is as its agent said
    assert _with_exits({"a": exited(0), "b": started()}, {2: 0}).state == "RUNNING"
    # the agent's own word stands when it has one
    assert _with_exits({"a": exited(0), "b": exited(0)}, {2: 1, 3: 1}).state == "SUCCEEDED"


def test_a_running_job_with_every_node_excluded_fails_instead_of_relaunching_on() -> None:
    r = decide(
        state="RUNNING", nodes=NODES, status={"a": exited(1), "b": exited(1)}, since=0.0, now=1.0,
        start_timeout=60.0, joined=BOTH, gpus_per_node=1, rendezvous=RDV, excluded={"a", "b"},
        healthy={"a", "b"}, max_rejoins=5,
    )  # fmt: skip
    assert (r.state, r.send, r.relaunch) == ("FAILED", "stop", ())
    assert "no live rank is left" in r.reason


def test_a_node_whose_relaunch_was_refused_is_not_relaunched_again() -> None:
    def relaunch(code: int) -> tuple[str, ...]:
        return decide(
            state="RUNNING", nodes=NODES, status={"a": started(), "b": exited(code)}, since=0.0, now=1.0,
            start_timeout=60.0, joined=BOTH, gpus_per_node=1, rendezvous=RDV, excluded={"b"}, healthy={"b"},
            rejoins={"b": 1}, max_rejoins=5,
        ).relaunch  # fmt: skip

    assert relaunch(137) == ("b",)  # killed: relaunched to rejoin
    assert relaunch(REJOIN_REFUSED_EXIT) == ()  # the relaunched rank said it cannot be taken back
