"""The job lifecycle decision, through every state and its guards."""

from __future__ import annotations

from services.jobs import decide, master_addr, master_port

NODES = ["a", "b"]


def d(state: str, status: dict[str, dict[str, object]], *, since: float = 0.0, now: float = 1.0):  # type: ignore[no-untyped-def]
    return decide(state=state, nodes=NODES, status=status, since=since, now=now, start_timeout=60.0)


def started() -> dict[str, object]:
    return {"state": "started"}


def exited(code: int, tail: str = "") -> dict[str, object]:
    return {"state": "exited", "exit_code": code, "log_tail": tail}


def test_pending_launches_and_starting_resends_until_every_node_answers() -> None:
    assert d("PENDING", {}).state == "STARTING" and d("PENDING", {}).send == "launch"
    r = d("STARTING", {"a": started()})
    assert (r.state, r.send) == ("STARTING", "launch")
    r = d("STARTING", {"a": started(), "b": started()})
    assert (r.state, r.send, r.reason) == ("RUNNING", None, "ranks started on a, b")


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
    assert all(29500 <= master_port(str(i)) < 30000 for i in range(1000))


def test_a_node_whose_ranks_the_plan_excluded_no_longer_counts_once_running() -> None:
    def x(state: str, status: dict[str, dict[str, object]]):  # type: ignore[no-untyped-def]
        return decide(state=state, nodes=NODES, status=status, since=0.0, now=1.0, start_timeout=60.0, excluded={"b"})

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
        return decide(state="RUNNING", nodes=NODES, status=status, since=0.0, now=1.0, start_timeout=60.0, **args)  # type: ignore[arg-type]

    assert x({"a": started(), "b": exited(-9)}).relaunch == ("b",)  # killed
    assert x({"a": started(), "b": exited(0)}).relaunch == ("b",)  # woke up excluded and left
    assert x({"a": started(), "b": {"state": "lost"}}).relaunch == ("b",)  # died while its agent was away
    assert x({"a": started(), "b": started()}).relaunch == ()  # still running (hung, or relaunched already)
    assert x({"a": started(), "b": exited(-9)}, healthy=set()).relaunch == ()  # its node is not HEALTHY yet
    assert x({"a": started(), "b": exited(-9)}, rejoins={"b": 3}).relaunch == ()  # relaunched often enough
    assert x({"a": started(), "b": exited(-9)}, max_rejoins=0).relaunch == ()  # rejoin off
    assert x({"a": started(), "b": exited(-9)}, excluded=set()).state == "FAILED"  # not excluded: a failure
    done = x({"a": exited(0), "b": exited(-9)})
    assert done.state == "SUCCEEDED" and done.relaunch == ()  # nothing to rejoin once the others are done


def test_master_addr_label_then_published_then_name() -> None:
    assert master_addr("bar-j1", "10.0.0.9", "10.1.1.1") == "10.0.0.9"  # the operator's label wins
    assert master_addr("bar-j1", None, "10.1.1.1") == "10.1.1.1"  # what the agent found
    assert master_addr("bar-j1", "", "") == "bar-j1"  # an agent that publishes no address
