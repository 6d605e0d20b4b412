"""The Slurm job backend's pure part (services/slurm/jobs/decide.py): parsing ``scontrol show job``, the
sbatch command line and batch script, and the state a job takes from Slurm's."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from services.slurm.jobs.decide import (
    SlurmJob,
    Submission,
    batch_script,
    decide,
    excluded,
    find,
    fold_rank_status,
    parse_job_line,
    parse_jobs,
    parse_sacct,
    rank_exits,
    rank_steps,
    relaunch,
    sacct_argv,
    sbatch_argv,
)

# recorded from the test Slurm (slurm-wlm 22.05.8), trimmed of fields nobody reads
LINE = (
    "JobId=12 JobName=pulse-ab12 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED AllocNode:Sid=localhost:21065 "
    "ReqNodeList=sj[1,3] ExcNodeList=sj2 NodeList=sj[1,3] BatchHost=sj1 NumNodes=2 NumCPUs=4 NumTasks=4 "
    "Command=(null) WorkDir=/work/a dir StdErr=/tmp/out.txt StdIn=/dev/null StdOut=/tmp/out.txt Power= "
)


def test_parse_a_oneliner() -> None:
    f = parse_job_line(LINE)
    assert f["JobId"] == "12" and f["AllocNode:Sid"] == "localhost:21065" and f["WorkDir"] == "/work/a dir"
    assert f["Power"] == ""
    jobs = parse_jobs(LINE + "\n\n" + LINE.replace("JobId=12", "JobId=13").replace("COMPLETED", "RUNNING"))
    assert jobs["12"] == SlurmJob("12", "pulse-ab12", "COMPLETED", "", "0:0", "sj[1,3]")
    assert jobs["13"].state == "RUNNING" and not jobs["13"].over and jobs["12"].over
    assert parse_jobs("No jobs in the system\n") == {}
    with pytest.raises(ValueError, match="without JobId"):
        parse_jobs("JobName=x JobState=RUNNING")


def test_find_by_id_else_by_name_the_newest() -> None:
    jobs = {i: SlurmJob(i, f"pulse-{n}", "RUNNING") for i, n in (("7", "a"), ("9", "a"), ("8", "b"))}
    assert find(jobs, job_id="a", slurm_job_id=None) == jobs["9"]
    assert find(jobs, job_id="a", slurm_job_id="7") == jobs["7"]
    assert find(jobs, job_id="c", slurm_job_id=None) is None
    assert find(jobs, job_id="a", slurm_job_id="99") is None


def test_exclude_every_node_not_usable() -> None:
    assert excluded(["n3", "n1", "n2", "n4"], {"n1", "n2"}) == ["n3", "n4"]


SUB = Submission(
    job_id="ab12", name="train", nodes=["n1", "n2"], gpus_per_node=4,
    entrypoint=["-m", "trainer.example", "--steps", "10", "--note", "it's"], master_port=29601,
    addrs={"n1": "10.0.0.1", "n2": ""}, exclude=["n3", "n9"], gres="gpu", partition="train",
    workdir="/work", output="/logs/", python="/venv/bin/python",
)  # fmt: skip


def test_sbatch_argv() -> None:
    assert sbatch_argv(["sudo", "-n", "sbatch"], SUB) == [
        "sudo", "-n", "sbatch", "--parsable", "--job-name=pulse-ab12", "--nodes=2", "--ntasks-per-node=4",
        "--nodelist=n1,n2", "--gres=gpu:4", "--exclude=n3,n9", "--partition=train", "--chdir=/work",
        "--output=/logs/pulse-ab12-%j.out", "--export=ALL", "--comment=clusterpulse job ab12 (train)",
    ]  # fmt: skip
    plain = Submission(
        job_id="x", name="y", nodes=["n1"], gpus_per_node=1, entrypoint=["t.py"], master_port=1, addrs={}, gres=""
    )
    argv = sbatch_argv(["sbatch"], plain)
    assert not any(a.startswith(("--gres", "--exclude", "--partition", "--chdir", "--output")) for a in argv)


def test_batch_script_gives_each_rank_the_launchers_environment() -> None:
    script = batch_script(SUB)
    assert "  n1) export MASTER_ADDR=10.0.0.1 ;;" in script and "n2)" not in script  # n2: no address known
    assert "export MASTER_PORT=29601 PULSE_JOB_ID=ab12" in script
    assert "export LOCAL_WORLD_SIZE=4 LOCAL_SIZE=4 WORLD_SIZE=8 CROSS_SIZE=2" in script
    # one task's death does not end the step; each task is its rank's supervisor (agent/slurm_rank.py)
    assert "srun --export=ALL --kill-on-bad-exit=0 --nodes=2 --ntasks-per-node=4 " in script
    assert (
        "/venv/bin/python -m agent.slurm_rank -- "
        "/venv/bin/python -u -m trainer.run -m trainer.example --steps 10 --note 'it'\"'\"'s'"
    ) in script
    assert "/venv/bin/python -m agent.job_store" in script and "TORCHELASTIC_USE_AGENT_STORE=True" in script
    # the relauncher of ranks that rejoin starts before the step, is told to finish after it, and waited for
    relauncher = "/venv/bin/python -m agent.slurm_rejoin --per=4 -- /venv/bin/python -m agent.slurm_rank -- "
    assert script.index(relauncher) < script.index("srun --export") < script.index('kill -TERM "$rejoin"')
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def _d(state: str, slurm: SlurmJob | None, **kw: object) -> tuple[str, str, str | None, str | None]:
    args: dict[str, object] = dict(
        state=state, job_id="ab12", slurm=slurm, slurm_job_id=None, since=100.0, created=100.0, now=101.0,
        joined=(), world=2, grace_s=5.0, start_timeout=60.0,
    )  # fmt: skip
    args.update(kw)
    d = decide(**args)  # type: ignore[arg-type]
    return d.state, d.reason, d.action, d.slurm_job_id


def S(state: str, reason: str = "", exit_code: str = "0:0") -> SlurmJob:
    return SlurmJob("41", "pulse-ab12", state, reason, exit_code, "n[1-2]")


def test_not_submitted_yet() -> None:
    assert _d("PENDING", None) == ("PENDING", "", "submit", None)
    assert _d("PENDING", None, submit_error="sbatch: refused")[2] == "submit"  # retried
    st, why, action, _ = _d("PENDING", None, submit_error="sbatch: refused", now=161.0)
    assert (st, action) == ("FAILED", None) and "within 60s; sbatch said: sbatch: refused" in why
    st, why, action, _ = _d("PENDING", None, unusable=["n2"])
    assert (st, action) == ("FAILED", None) and "n2 no longer HEALTHY and schedulable" in why


def test_state_follows_slurm() -> None:
    assert _d("PENDING", S("PENDING", "Resources")) == ("PENDING", "Slurm job 41 PENDING: Resources", None, "41")
    assert _d("PENDING", S("PENDING"), slurm_job_id="41")[3] is None  # known: nothing to store
    assert _d("PENDING", S("RUNNING"))[:2] == ("STARTING", "Slurm job 41 RUNNING on n[1-2]: 0 of 2 ranks joined")
    assert _d("STARTING", S("RUNNING"), joined={0, 5})[0] == "STARTING"  # rank 5 is outside the world
    assert _d("STARTING", S("RUNNING"), joined={0, 1})[0] == "RUNNING"
    assert _d("RUNNING", S("RUNNING"))[0] == "RUNNING"
    st, why, action, _ = _d("STARTING", S("RUNNING"), joined={1}, now=161.0)  # start_timeout 60 after since
    assert (st, action) == ("FAILED", "cancel"), why
    assert why == (
        "ranks did not rendezvous within 60 s of Slurm job 41 running on n[1-2]: "
        "1 of 2 ranks registered or reported a step; cancelled"
    )
    assert _d("RUNNING", S("RUNNING"), now=1000.0)[0] == "RUNNING"  # the timeout is the start's only
    assert _d("RUNNING", S("COMPLETING"))[:2] == ("RUNNING", "")
    assert _d("RUNNING", S("COMPLETED"))[:2] == ("SUCCEEDED", "Slurm job 41 COMPLETED (exit 0:0)")
    st, why, _, _ = _d("RUNNING", S("FAILED", "NonZeroExitCode", "1:0"))
    assert (st, why) == ("FAILED", "Slurm job 41 FAILED (exit 1:0, reason NonZeroExitCode)")
    assert _d("RUNNING", S("TIMEOUT"))[0] == "FAILED"
    assert _d("RUNNING", S("NODE_FAIL"))[0] == "FAILED"
    assert _d("RUNNING", S("CANCELLED"))[:2] == ("STOPPED", "Slurm job 41 CANCELLED (exit 0:0): cancelled in Slurm")
    st, why, _, _ = _d("RUNNING", None, slurm_job_id="41")
    assert st == "FAILED" and "no longer listed" in why  # no rank reported an exit, nothing to wait for
    assert _d("SUCCEEDED", S("RUNNING")) == ("SUCCEEDED", "", None, None)  # terminal stays


def test_an_excluded_ranks_exit_does_not_fail_a_job_whose_other_ranks_exited_0() -> None:
    failed = S("FAILED", "NonZeroExitCode", "137:0")
    kw: dict[str, object] = dict(world=3, exits={0: 0, 1: 137, 2: 0}, excluded_ranks={1})
    st, why, _, _ = _d("RUNNING", failed, **kw)
    assert st == "SUCCEEDED", why
    assert why == (
        "Slurm job 41 FAILED (exit 137:0, reason NonZeroExitCode): ranks excluded by the plan: rank 1 137; "
        "the 2 others exited 0"
    )
    # a rank the plan still counts failed: FAILED, naming it
    st, why, _, _ = _d("RUNNING", failed, world=3, exits={0: 0, 1: 137, 2: 1}, excluded_ranks={1})
    assert (st, why) == ("FAILED", "Slurm job 41 FAILED (exit 137:0, reason NonZeroExitCode); rank 1 137, rank 2 1")
    # nobody excluded: the failed rank counts
    assert _d("RUNNING", failed, world=3, exits={0: 0, 1: 137, 2: 0})[0] == "FAILED"
    # not RUNNING yet (the ranks never all joined): exclusions do not count, as with the agents
    assert _d("STARTING", failed, **kw)[0] == "FAILED"
    # a counted rank's exit not reported yet: wait up to exit_wait_s after Slurm's end, then FAILED
    late = dict(world=3, exits={0: 0, 1: 137}, excluded_ranks={1}, exit_wait_s=10.0)
    assert _d("RUNNING", failed, **late, ended_for=2.0)[:3] == ("RUNNING", "", None)
    assert _d("RUNNING", failed, **late, ended_for=10.0)[0] == "FAILED"
    # every rank excluded: nothing finished the job
    assert _d("RUNNING", failed, world=2, exits={0: 9, 1: 9}, excluded_ranks={0, 1})[0] == "FAILED"


def test_a_job_slurm_forgot_is_decided_by_its_ranks_exits() -> None:
    gone: dict[str, object] = dict(slurm_job_id="41", world=2, exit_wait_s=10.0)
    st, why, _, _ = _d("RUNNING", None, **gone, exits={0: 0, 1: 0}, ended_for=0.0)
    assert (st, why) == (
        "SUCCEEDED",
        "Slurm job 41 is no longer listed by Slurm (its end was not seen): all 2 ranks exited 0",
    )
    assert _d("RUNNING", None, **gone, exits={0: 0, 1: None}, ended_for=1.0)[:2] == ("RUNNING", "")  # waits
    st, why, _, _ = _d("RUNNING", None, **gone, exits={0: 0, 1: None}, ended_for=10.0)
    assert (st, why) == (
        "FAILED",
        "Slurm job 41 is no longer listed by Slurm (its end was not seen)",
    )  # never RUNNING for ever
    st, why, _, _ = _d("RUNNING", None, **gone, exits={0: 0, 1: 3}, ended_for=0.0)
    assert (st, why) == ("FAILED", "Slurm job 41 is no longer listed by Slurm (its end was not seen); rank 1 3")
    assert _d("RUNNING", None, **gone, exits={0: 0, 1: 143}, excluded_ranks={1})[0] == "SUCCEEDED"


def test_rank_statuses_fold_into_their_nodes() -> None:
    a = fold_rank_status(None, {"state": "started", "rank": 2, "node": "n1"})
    assert (a["state"], a["exit_code"], a["ranks"]) == ("started", None, {"2": None})
    b = fold_rank_status(a, {"state": "started", "rank": 3, "node": "n1"})
    c = fold_rank_status(b, {"state": "exited", "rank": 3, "exit_code": 137, "node": "n1"})
    assert (c["state"], c["ranks"]) == ("started", {"2": None, "3": 137})  # rank 2 still runs
    d = fold_rank_status(c, {"state": "exited", "rank": 2, "exit_code": 0, "node": "n1"})
    assert (d["state"], d["exit_code"]) == ("exited", 137)  # the first failure, as the agents report a node
    again = fold_rank_status(d, {"state": "started", "rank": 3, "node": "n1"})  # relaunched to rejoin
    assert (again["state"], again["ranks"]) == ("started", {"2": 0, "3": None})
    assert rank_exits({"n1": d, "n2": {"state": "exited", "exit_code": 0}}) == {2: 0, 3: 137}  # an agent's: no ranks


def test_an_excluded_node_whose_ranks_exited_is_relaunched_while_healthy_under_the_cap() -> None:
    exited = {"state": "exited", "node_rank": 2, "ranks": {"4": 137, "5": 0}}
    status = {"n1": {"state": "started", "node_rank": 0, "ranks": {"0": None, "1": None}}, "n3": exited}
    kw: dict[str, object] = dict(node_status=status, excluded={4, 5}, healthy={"n1", "n3"}, rejoins={}, max_rejoins=2,
                                 per_node=2)  # fmt: skip
    assert relaunch(**kw) == [("n3", 2)]  # its place in the job: Slurm's node order, as its ranks reported it
    assert relaunch(**{**kw, "excluded": {4}}) == []  # rank 5 still counts
    assert relaunch(**{**kw, "healthy": {"n1"}}) == []  # not HEALTHY (or drained in Slurm)
    assert relaunch(**{**kw, "rejoins": {"n3": 2}}) == []  # the cap
    running = {**status, "n3": {**exited, "ranks": {"4": 137, "5": None}}}
    assert relaunch(**{**kw, "node_status": running}) == []  # rank 5 still runs
    half = {**status, "n3": {**exited, "ranks": {"4": 137}}}
    assert relaunch(**{**kw, "node_status": half}) == []  # rank 5 never reported: not known to be gone


def test_a_rejoined_ranks_last_run_decides() -> None:
    # rank 1 was killed (137), relaunched, rejoined (no longer excluded) and exited 0: Slurm's batch
    # exit is the first step's 137, the job SUCCEEDED
    st, why, _, _ = _d("RUNNING", S("FAILED", "NonZeroExitCode", "137:0"), world=3, exits={0: 0, 1: 0, 2: 0})
    assert (st, why) == ("SUCCEEDED", "Slurm job 41 FAILED (exit 137:0, reason NonZeroExitCode): all 3 ranks exited 0")


def test_stop_is_term_then_kill_after_the_grace_then_stopped() -> None:
    assert _d("STOPPING", S("RUNNING"), now=101.0)[2] == "term"
    assert _d("STOPPING", S("RUNNING"), now=105.0)[2] == "kill"
    assert _d("STOPPING", S("COMPLETING"), now=101.0)[2] is None  # Slurm is ending it: nothing to signal
    assert _d("STOPPING", S("COMPLETING"), now=105.0)[:3] == ("STOPPING", "", None)
    assert _d("STOPPING", S("FAILED", exit_code="0:15"))[:2] == ("STOPPED", "Slurm job 41 ended FAILED (exit 0:15)")
    assert _d("STOPPING", None)[:2] == ("STOPPED", "stopped before it was submitted to Slurm")
    assert _d("STOPPING", None, slurm_job_id="41")[:2] == ("STOPPED", "Slurm job 41 is gone")


def test_rank_steps_leave_the_batch_shell_out() -> None:
    text = (
        "StepId=1.batch UserId=0 State=RUNNING NodeList=sj1 Nodes=1 CPUs=0 Tasks=1 Name=batch\n"
        "StepId=1.extern UserId=0 State=RUNNING NodeList=sj[1-2] Name=extern\n"
        "StepId=1.0 UserId=0 State=RUNNING NodeList=sj[1-2] Nodes=2 CPUs=2 Tasks=2 Name=sh SrunHost:Pid=vm:15243\n"
    )
    assert rank_steps(text) == ["1.0"]
    assert rank_steps("") == []


def test_the_slurm_job_backend_as_default_needs_slurm_on() -> None:
    from pydantic import ValidationError

    from clusterpulse.settings import load_settings

    with pytest.raises(ValidationError, match="PULSE_JOB_BACKEND=slurm needs PULSE_SLURM=on"):
        load_settings(job_backend="slurm")
    assert load_settings(job_backend="slurm", slurm=True).job_backend == "slurm"
    with pytest.raises(ValidationError, match="slurm_gres"):
        load_settings(slurm_gres="gpu:4")  # the count is the job's gpus_per_node


# sacct --jobs 12 --noheader --parsable2 --allocations --format=JobID,JobName,State,ExitCode,NodeList,Reason
# in sacct's documented --parsable2 layout (the test Slurm has no slurmdbd, so nothing recorded there)
SACCT = "12|pulse-ab12|FAILED|137:0|sj[1,3]|None\n"


def test_sacct_reads_the_jobs_own_record() -> None:
    argv = sacct_argv(["sacct"], "12")
    assert argv[:6] == ["sacct", "--jobs", "12", "--noheader", "--parsable2", "--allocations"]
    assert argv[6] == "--format=JobID,JobName,State,ExitCode,NodeList,Reason"
    assert parse_sacct(SACCT, "12") == SlurmJob("12", "pulse-ab12", "FAILED", "", "137:0", "sj[1,3]")
    cancelled = parse_sacct("12|pulse-ab12|CANCELLED by 0|0:15|sj1|None\n", "12")
    assert cancelled is not None and cancelled.state == "CANCELLED" and cancelled.over
    assert parse_sacct("", "12") is None and parse_sacct(SACCT, "13") is None  # no record of it
    with pytest.raises(ValueError, match="expected JobID,JobName"):
        parse_sacct("12 FAILED", "12")
    # what sacct found is decided as if scontrol still listed it
    assert _d("RUNNING", parse_sacct(SACCT, "12"), slurm_job_id="12")[0] == "FAILED"
