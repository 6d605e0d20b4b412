"""The ``pulse`` command. Each subcommand imports only what it needs, so ``pulse agent`` stays small."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from clusterpulse.proc import LOG_FORMAT
from clusterpulse.settings import Settings, load_settings
from clusterpulse.states import TERMINAL_JOB_STATES, JobState


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    for noisy in ("httpx", "alembic", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _settings(**overrides: Any) -> Settings:
    return load_settings(**{k: v for k, v in overrides.items() if v is not None})


async def _until_signal(main: Callable[[asyncio.Event], Any]) -> None:
    """Run ``main(stop)``; SIGINT/SIGTERM set ``stop`` for a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await main(stop)


# --- agent / simulate ---------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    from agent.daemon import parse_labels, run_node_agent
    from agent.simulated import parse_fault
    from clusterpulse import wire

    if args.addr is not None and not wire.valid_addr(args.addr):
        raise SystemExit(f"pulse agent: --addr {args.addr!r}: expected a host name or an IP address, no port")
    settings = _settings(heartbeat_interval_s=args.interval, agent_addr=args.addr)
    faults = [parse_fault(f) for f in args.fault]
    if faults and args.source != "simulated":
        raise SystemExit("pulse agent: --fault needs --source simulated")
    for f in faults:
        if f.node not in (None, args.node):
            raise SystemExit(f"pulse agent: --fault {f.node}=...: this agent is {args.node}")
    labels = parse_labels(args.label)
    asyncio.run(
        _until_signal(
            lambda stop: run_node_agent(
                settings,
                node=args.node,
                source=args.source,
                gpus=args.gpus,
                interval_s=settings.heartbeat_interval_s,
                labels=labels,
                faults=faults,
                stop=stop,
                jobs=not args.no_jobs,
            )
        )
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.daemon import run_simulation
    from agent.simulated import parse_fault

    settings = _settings(heartbeat_interval_s=args.interval)
    faults = [parse_fault(f) for f in args.fault]

    async def main(stop: asyncio.Event) -> None:
        if args.duration:
            asyncio.get_running_loop().call_later(args.duration, stop.set)
        await run_simulation(
            settings,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            interval_s=settings.heartbeat_interval_s,
            faults=faults,
            prefix=args.prefix,
            stop=stop,
        )

    asyncio.run(_until_signal(main))
    return 0


# --- orchestrator / db --------------------------------------------------------------------------


def cmd_orchestrator(args: argparse.Namespace) -> int:
    import uvicorn

    from services.api import create_app

    settings = _settings()
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    """One ingest process (services/ingest_worker.py), for a leader whose replicas run with
    PULSE_INGEST_PROCESSES > 0, on any host that reaches Redis."""
    from services import ingest_worker

    asyncio.run(ingest_worker.run(_settings()))
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from services import db
    from services.routes.common import redact

    settings = _settings()
    db.ensure_sqlite_dir(settings.database_url)
    head = db.upgrade(settings.database_url)
    print(f"database {redact(settings.database_url)} at revision {head}")
    return 0


# --- on-call client -----------------------------------------------------------------------------


class ApiError(SystemExit):
    pass


def _client(settings: Settings) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    return httpx.Client(base_url=settings.api_url, headers=headers, timeout=10.0)


def _call(method: str, path: str, **kw: Any) -> Any:
    import httpx

    settings = _settings()
    try:
        with _client(settings) as c:
            r = c.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise ApiError(
            f"pulse: cannot reach the orchestrator at {settings.api_url} ({exc}); set PULSE_API_URL"
        ) from None
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise ApiError(f"pulse: {method} {path} -> {r.status_code}: {detail}")
    return r.json()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}m"


def _sched(n: dict[str, Any]) -> str:
    """yes; cordoned (here); slurm (drained or down in Slurm, by whoever)."""
    if n["schedulable"]:
        return "yes"
    sch = n.get("scheduler")
    return "slurm" if sch is not None and not sch["available"] else "cordoned"


def _slurm_state(n: dict[str, Any]) -> str:
    """Slurm's state beside ours: ``idle``, ``idle+drain (ours)``, ``down (root: maint)``."""
    sch = n.get("scheduler")
    if sch is None:
        return "-"
    if sch["drained_by_clusterpulse"]:
        return f"{sch['state']} (ours)"
    if sch["reason"]:
        who = f"{sch['reason_set_by']}: " if sch["reason_set_by"] else ""
        return f"{sch['state']} ({who}{sch['reason'][:40]})"
    return str(sch["state"])


def format_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    slurm = any(n.get("scheduler") is not None for n in nodes)
    rows = [("NODE", "STATE", *(("SLURM",) if slurm else ()), "SCHED", "HB AGE", "GPUS", "PSUS", "REASON")]
    for n in nodes:
        rows.append(
            (
                n["name"],
                n["state"],
                *((_slurm_state(n),) if slurm else ()),
                _sched(n),
                _age(n["heartbeat_age_seconds"]),
                str(len(n["gpus"])),
                str(len(n["psus"])),
                n["reason"][:90],
            )
        )
    return _table(rows)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"


def format_events(events: Sequence[dict[str, Any]]) -> str:
    rows = [("TIME", "KIND", "NODE", "CHANGE", "ACTOR", "REASON")]
    for e in events:
        change = f"{e['from_state']} -> {e['to_state']}" if e["to_state"] else ""
        rows.append((_when(e["at"]), e["kind"], e["node"] or "-", change, e["actor"], e["reason"][:100]))
    return _table(rows)


def cmd_nodes(args: argparse.Namespace) -> int:
    if args.action == "list":
        params = {"state": args.state} if args.state else {}
        woken = _woken_by(lambda e: e["node"] is not None) if args.watch and not args.json else None
        while True:
            data = _call("GET", "/v1/nodes", params=params)
            if args.json:
                print(json.dumps(data, indent=2))
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")
                    counts: dict[str, int] = {}
                    for n in data["data"]:
                        counts[n["state"]] = counts.get(n["state"], 0) + 1
                    print(f"{time.strftime('%H:%M:%S')}  " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items())))
                print(format_nodes(data["data"]))
            if not args.watch:
                return 0
            sys.stdout.flush()
            _wait(woken, args.watch)  # a node's event redraws at once; ages refresh every S s
    if not args.name:
        raise SystemExit(f"pulse nodes {args.action}: NAME is required")
    if args.action == "show":
        node = _call("GET", f"/v1/nodes/{args.name}")
        if args.json:
            print(json.dumps(node, indent=2))
        else:
            print(format_node(node))
        return 0
    body = {"reason": args.reason} if args.reason else None
    out = _call("POST", f"/v1/nodes/{args.name}/{args.action}", json=body)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        verb = "cordoned" if args.action == "cordon" else "uncordoned"
        print(f"{args.name} {verb}" + ("" if out["changed"] else " (no change: it already was)"))
    return 0


def format_node(n: dict[str, Any]) -> str:
    lines = [
        f"{n['name']}  {n['state']}  since {_when(n['state_since'])}  {'schedulable' if n['schedulable'] else 'NOT SCHEDULABLE (' + _sched(n) + ')'}",
        f"  reason:    {n['reason']}",
        f"  heartbeat: {_age(n['heartbeat_age_seconds'])} ago, clock skew {n['clock_skew_seconds']}s, agent {n['agent']}",
        f"  labels:    {n['labels']}",
    ]
    if (sch := n.get("scheduler")) is not None:
        by = f" (set by {sch['reason_set_by']} at {sch['reason_set_at']})" if sch["reason_set_by"] else ""
        ours = ", drained by ClusterPulse" if sch["drained_by_clusterpulse"] else ""
        lines.append(
            f"  slurm:     {sch['state']}{ours}" + (f", reason {sch['reason']!r}{by}" if sch["reason"] else "")
        )
    lines += [f"  fault:     {f}" for f in n["faults"]] + [f"  warning:   {w}" for w in n["warnings"]]
    rows = [("GPU", "NAME", "UTIL", "TEMP", "POWER", "PCIE", "THROTTLE", "ECC-U", "XID")]
    for g in n["gpus"]:
        if g.get("lost"):
            rows.append((str(g["index"]), "LOST", "-", "-", "-", "-", "-", "-", g.get("error") or ""))
            continue
        rows.append(
            (
                str(g["index"]),
                g.get("name", ""),
                f"{(g.get('utilization_ratio') or 0) * 100:.0f}%",
                f"{g.get('temperature_celsius')}C",
                f"{g.get('power_watts')}/{g.get('power_limit_watts')}W",
                f"x{g.get('pcie_link_width')}/x{g.get('pcie_link_width_max')}",
                ",".join(g.get("throttle") or []) or "-",
                str(g.get("ecc_volatile_uncorrected")),
                ",".join(map(str, g.get("xids_recent") or [])) or "-",
            )
        )
    lines.append(_table(rows))
    prow = [("PSU", "OK", "IN W", "IN A", "OUT A", "STATUS")]
    for p in n["psus"]:
        prow.append(
            (
                p["name"],
                str(p.get("ok")),
                str(p.get("input_power_watts")),
                str(p.get("input_current_amperes")),
                str(p.get("output_current_amperes")),
                p.get("status", ""),
            )
        )
    if n["psus"]:
        lines.append(_table(prow))
    return "\n".join(lines)


def cmd_slurm(args: argparse.Namespace) -> int:
    """``pulse slurm status`` and ``pulse slurm reset-breaker`` (operator)."""
    out = _call("POST", "/v1/slurm/breaker/reset") if args.action == "reset-breaker" else _call("GET", "/v1/slurm")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    st = out["slurm"] if args.action == "reset-breaker" else out
    if args.action == "reset-breaker":
        print("drain breaker closed" if out["changed"] else "drain breaker was not open (no change)")
    if not st["enabled"]:
        print("Slurm sync is off (PULSE_SLURM)")
        return 0
    print(
        f"drain breaker: {'OPEN since ' + _when(st['breaker_since']) + ': ' + st['breaker_reason'] if st['breaker_open'] else 'closed'}"
    )
    print(f"last sync:     {_when(st['last_sync_at']) if st['last_sync_at'] else 'never'}  {st['last_error']}")
    print(f"sync errors:   {st['sync_errors']}")
    for node, reason in st["drained_by_clusterpulse"].items():
        print(f"drained by us: {node}  {reason}")
    return 0


def _follow_events(args: argparse.Namespace, since_id: int | None) -> int:
    """``pulse events --follow``: the event stream (GET /v1/stream) after ``since_id``, one line
    (or one JSON object) per event, filtered here by --node/--job; reconnects by itself."""
    from tools.sse import StreamRefused, follow

    settings = _settings()

    def dropped(exc: Exception) -> None:
        print(f"pulse: event stream from {settings.api_url} dropped ({exc}); reconnecting", file=sys.stderr)

    with _client(settings) as c:
        try:
            for msg in follow(c, since_id=since_id, on_reconnect=dropped):
                e = msg.data
                if e is None or (args.node and e["node"] != args.node) or (args.job and e["job"] != args.job):
                    continue
                print(json.dumps(e) if args.json else format_event_line(e), flush=True)
        except StreamRefused as exc:
            raise ApiError(f"pulse: {exc}") from None
        except KeyboardInterrupt:
            return 0
    return 0


def format_event_line(e: dict[str, Any]) -> str:
    change = f"{e['from_state']} -> {e['to_state']}" if e["to_state"] else ""
    return "  ".join(x for x in (_when(e["at"]), e["kind"], e["node"] or "-", change, e["actor"], e["reason"]) if x)


def cmd_events(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.node:
        params["node"] = args.node
    if args.job:
        params["job"] = args.job
    if args.since is not None:
        params["since"] = time.time() - args.since
    data = _call("GET", "/v1/events", params=params)
    if args.follow:  # the history first, then everything after its last event, one per line
        for e in data["data"]:
            print(json.dumps(e) if args.json else format_event_line(e), flush=True)
        return _follow_events(args, max((e["id"] for e in data["data"]), default=None))
    print(json.dumps(data, indent=2) if args.json else format_events(data["data"]))
    return 0


def format_jobs(jobs: Sequence[dict[str, Any]]) -> str:
    """One row a job; STEP/S is the pace the slowest rank's last step sets (1 / its step time)."""
    rows = [("JOB", "NAME", "STATE", "NODES", "STEP", "STEP/S", "LOSS", "MFU", "REASON")]
    for j in jobs:
        p = j.get("progress") or {}
        loss, mfu, step_s = p.get("loss"), p.get("mfu_ratio"), p.get("step_time_s")
        rows.append(
            (
                j["id"],
                j["name"],
                j["state"],
                ",".join(j["assigned_nodes"]),
                str(p.get("step", "-")),
                f"{1 / step_s:.2f}" if step_s else "-",
                "-" if loss is None else f"{loss:.4f}",
                "-" if mfu is None else f"{mfu:.3f}",
                j["reason"][:80],
            )
        )
    return _table(rows)


def _woken_by(wanted: Callable[[dict[str, Any]], bool]) -> queue.Queue[Any]:
    """The events (GET /v1/stream) ``wanted`` accepts, as they come (tools/sse.py ``wake_on``)."""
    from tools.sse import wake_on

    return wake_on(_client(_settings()), wanted=wanted)


def _wait(woken: queue.Queue[Any] | None, every: float) -> None:
    """Until an event woke us, or ``every`` seconds; then whatever else came meanwhile is taken too."""
    if woken is None:
        time.sleep(every)
        return
    with contextlib.suppress(queue.Empty):
        woken.get(timeout=every)
        while True:
            woken.get_nowait()


def _follow(job_id: str, every: float = 1.0) -> int:
    """Follow a job until it ends, exit 0 only for SUCCEEDED: its state changes (and plan and rank
    events) from the event stream at once, its step and loss every ``every`` seconds."""
    woken = _woken_by(lambda e: e["job"] == job_id)
    last = ""
    while True:
        j = _call("GET", f"/v1/jobs/{job_id}")
        p = j.get("progress") or {}
        line = f"{j['state']:<10} step={p.get('step', '-')} loss={p.get('loss')} mfu={p.get('mfu_ratio')} " + (
            f"tokens/s={p.get('tokens_per_s')} ({j['reason']})"
        )
        if line != last:
            print(f"{time.strftime('%H:%M:%S')} {job_id} {line}", flush=True)
            last = line
        if j["state"] in TERMINAL_JOB_STATES:
            return 0 if j["state"] == JobState.SUCCEEDED else 1
        _wait(woken, every)


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"pulse jobs start: {flag} {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.action == "list":
        params = {"state": args.state} if args.state else {}
        data = _call("GET", "/v1/jobs", params=params)
        print(json.dumps(data, indent=2) if args.json else format_jobs(data["data"]))
        return 0
    if args.action == "start":
        entry = list(args.entry)
        if not entry or not args.name:
            raise SystemExit("pulse jobs start: --name and an entrypoint after -- are required")
        body: dict[str, Any] = {
            "name": args.name,
            "nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node,
            "entrypoint": entry,
            "env": _pairs(args.env, "--env"),
            "selector": _pairs(args.selector, "--selector"),
        }
        if args.backend:
            body["backend"] = args.backend
        if args.deepspeed_config:
            with open(args.deepspeed_config) as fh:
                body["deepspeed_config"] = json.load(fh)
        headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
        job = _call("POST", "/v1/jobs", json=body, headers=headers)
        print(
            json.dumps(job, indent=2)
            if args.json
            else f"job {job['id']} {job['state']} on {', '.join(job['assigned_nodes'])}"
            + (" (Slurm)" if job.get("backend") == "slurm" else "")
        )
        return _follow(job["id"]) if args.follow else 0
    if not args.rest:
        raise SystemExit(f"pulse jobs {args.action}: JOB is required")
    job_id = args.rest[0]
    if args.action == "checkpoint":
        asked = _call("POST", f"/v1/jobs/{job_id}/checkpoint", json={"reason": args.reason})
        print(
            json.dumps(asked, indent=2)
            if args.json
            else f"checkpoint of job {job_id} asked (request {asked['request']}): SIGUSR2 to every rank on "
            f"{', '.join(asked['nodes'])}; `pulse events --job {job_id}` shows checkpoint_written"
        )
        return 0
    job = _call("POST", f"/v1/jobs/{job_id}/stop") if args.action == "stop" else _call("GET", f"/v1/jobs/{job_id}")
    if args.follow:
        return _follow(job_id)
    print(json.dumps(job, indent=2) if args.json else format_jobs([job]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    p = _call("GET", f"/v1/jobs/{args.job}/plan")
    if args.json:
        print(json.dumps(p, indent=2))
        return 0
    print(f"job {p['job']} generation {p['generation']}: {p['reason']}")
    if p.get("refused"):
        print(f"  REFUSED (old plan stays): {p['refused']}")
    rows = [("RANK", "NODE", "ROLE")]
    for rank, node in p["ranks"].items():
        r = int(rank)
        role = (
            f"proxied by {p['proxies'][rank]}"
            if rank in p["proxies"]
            else "excluded"
            if r in p["excluded"]
            else "participant"
        )
        rows.append((rank, node, role))
    print(_table(rows))
    return 0


def format_tokens(tokens: Sequence[dict[str, Any]]) -> str:
    rows = [("NAME", "ROLE", "STATE", "CREATED", "BY", "REVOKED")]
    for t in tokens:
        revoked = f"{_when(t['revoked_at'])} by {t['revoked_by']}" if t["revoked_at"] is not None else "-"
        state = "active" if t["active"] else "revoked"
        rows.append((t["name"], t["role"], state, _when(t["created_at"]), t["created_by"], revoked))
    return _table(rows)


def cmd_tokens(args: argparse.Namespace) -> int:
    if args.action == "create":
        if not args.name or not args.role:
            raise SystemExit("pulse tokens create: --name and --role are required")
        t = _call("POST", "/v1/tokens", json={"name": args.name, "role": args.role})
        if args.json:
            print(json.dumps(t, indent=2))
        else:  # the secret alone on stdout, so that $(pulse tokens create ...) captures it
            print(f"token {t['name']} ({t['role']}) created; its secret is shown only this once:", file=sys.stderr)
            print(t["secret"])
        return 0
    if args.action == "list":
        data = _call("GET", "/v1/tokens")
        print(json.dumps(data, indent=2) if args.json else format_tokens(data["data"]))
        return 0
    if not args.name:
        raise SystemExit("pulse tokens revoke: NAME is required")
    out = _call("POST", f"/v1/tokens/{args.name}/revoke")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"token {args.name} revoked" + ("" if out["changed"] else " (no change: it already was)"))
    return 0


# --- Redis credentials --------------------------------------------------------------------------


def _credentials_password(path: str | None) -> str:
    """The password in ``path``; a new one when no path is given, or written there (0600) when the
    file does not exist yet."""
    from pathlib import Path

    from clusterpulse import acl

    if path is None:
        return acl.new_password()
    file = Path(path)
    if file.exists():
        password = file.read_text().strip()
        if not password:
            raise SystemExit(f"pulse agent-credentials: --password-file {path} is empty; expected a password")
        return password
    password = acl.new_password()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def cmd_agent_credentials(args: argparse.Namespace) -> int:
    from clusterpulse import acl

    if args.orchestrator == bool(args.node):
        raise SystemExit("pulse agent-credentials: give a NODE or --orchestrator (one of the two)")
    settings = _settings()
    password = _credentials_password(args.password_file)
    try:
        rules = (
            acl.orchestrator_acl(password=password)
            if args.orchestrator
            else acl.node_acl(args.node, shards=settings.heartbeat_stream_shards, password=password)
        )
    except ValueError as exc:
        raise SystemExit(f"pulse agent-credentials: {exc}") from None
    url = acl.credentials_url(settings.redis_url, username=rules[0], password=password)
    if args.apply:
        import redis

        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.redis_timeout_s, socket_connect_timeout=settings.redis_timeout_s
        )
        try:
            client.execute_command("ACL", "SETUSER", *rules)  # type: ignore[no-untyped-call]
        except redis.RedisError as exc:
            print(f"pulse agent-credentials: ACL SETUSER {rules[0]} failed at PULSE_REDIS_URL: {exc}", file=sys.stderr)
            return 1
        finally:
            client.close()
        print(
            f"ACL user {rules[0]} applied (heartbeat_stream_shards={settings.heartbeat_stream_shards}); persist it "
            "with ACL SAVE (aclfile) or CONFIG REWRITE. Its URL, holding the password:",
            file=sys.stderr,
        )
    else:
        print(
            f"# ACL user {rules[0]} (heartbeat_stream_shards={settings.heartbeat_stream_shards}); apply the first "
            "line with redis-cli as an admin, or run again with --apply. The second line holds the password.",
            file=sys.stderr,
        )
        print(acl.redis_cli_line(rules))
    print(f"PULSE_REDIS_URL={url}")
    return 0


# --- demo / bench -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from tools.demo import run_demo

    rc: int = run_demo(args)
    return rc


def cmd_check(args: argparse.Namespace) -> int:
    from trainer.check_reroute import CheckConfig, CheckFailed, parse_ranks, run_check

    cfg = CheckConfig(
        world_size=args.world_size,
        degrade=parse_ranks("--degrade", args.degrade),
        exclude=parse_ranks("--exclude", args.exclude),
        hang=args.hang,
        steps=args.steps,
        repeats=args.repeats,
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        bucket_mb=args.bucket_mb,
        lr=args.lr,
        proxy_timeout_s=args.proxy_timeout,
        stock_timeout_s=args.stock_timeout,
        timeout_s=args.timeout,
        tolerance=args.tolerance,
        threads=args.threads,
    )
    try:
        result = run_check(cfg)
    except CheckFailed as exc:
        print(f"pulse check reroute: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {json.dumps(value)}")
    return 0 if result["ok"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from tools.bench import run_bench

    rc: int = run_bench(args)
    return rc


def cmd_goodput(args: argparse.Namespace) -> int:
    from tools.goodput import run_goodput

    return run_goodput(args)


def _demo_parser(sub: Any) -> None:
    m = sub.add_parser("demo", help="orchestrator + 16 simulated nodes on this machine, a training job, a fault")
    m.add_argument("--nodes", type=int, default=16)
    m.add_argument("--port", type=int, default=0, help="orchestrator port (0: a free one)")
    m.add_argument(
        "--fault-after", type=float, default=20.0, help="seconds to the PSU fault (training: after the first step)"
    )
    m.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: until Ctrl-C)")
    m.add_argument("--no-train", action="store_true", help="no trainer.example job on 4 of the nodes")
    m.set_defaults(fn=cmd_demo)


def _events_parser(sub: Any) -> None:
    e = sub.add_parser("events", help="health transitions and operator actions")
    e.add_argument("--node")
    e.add_argument("--job", help="only this job's events (its states, checkpoints)")
    e.add_argument("--since", type=float, help="only the last S seconds")
    e.add_argument("--limit", type=int, default=100)
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then follow the event stream (GET /v1/stream), one line (--json: one object) per event, until Ctrl-C",
    )
    e.set_defaults(fn=cmd_events)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pulse", description="ClusterPulse: the control plane of a GPU training cluster.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    _daemon_commands(sub)
    _api_commands(sub)
    _tool_commands(sub)
    return p


Subparsers = Any  # argparse's _SubParsersAction, private in typeshed


def _daemon_commands(sub: Subparsers) -> None:
    """The processes: agent, simulate, orchestrator, db."""
    a = sub.add_parser("agent", help="run one node's agent")
    a.add_argument("--node", required=True)
    a.add_argument("--source", choices=("auto", "nvml", "simulated"), default="auto")
    a.add_argument("--gpus", type=int, default=8, help="GPUs to simulate (--source simulated)")
    a.add_argument("--interval", type=float, help="heartbeat interval, seconds (PULSE_HEARTBEAT_INTERVAL_S)")
    a.add_argument("--label", action="append", default=[], help="topology label KEY=VALUE (repeatable)")
    a.add_argument(
        "--addr",
        help="the address other nodes reach this one at, the rendezvous of jobs it leads "
        "(PULSE_AGENT_ADDR; default: found by the agent, see agent/address.py)",
    )
    a.add_argument("--fault", action="append", default=[], help="KIND@SECONDS[+DURATION] (simulated only)")
    a.add_argument("--no-jobs", action="store_true", help="do not run the job launcher")
    a.set_defaults(fn=cmd_agent)

    s = sub.add_parser("simulate", help="run N simulated agents in one process")
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--interval", type=float)
    s.add_argument("--fault", action="append", default=[], help="NODE=KIND@SECONDS[+DURATION] (repeatable)")
    s.add_argument("--prefix", default="sim")
    s.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: until Ctrl-C)")
    s.set_defaults(fn=cmd_simulate)

    o = sub.add_parser("orchestrator", help="run the orchestrator (REST API, /metrics, health loops)")
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, default=8000)
    o.set_defaults(fn=cmd_orchestrator)

    i = sub.add_parser("ingest", help="one ingest process: reads heartbeat streams, hands the leader observations")
    i.set_defaults(fn=cmd_ingest)

    d = sub.add_parser("db", help="database schema")
    d.add_argument("action", choices=("upgrade",))
    d.set_defaults(fn=cmd_db)


def _api_commands(sub: Subparsers) -> None:
    """On call, over the REST API: nodes, slurm, events, jobs, plan, tokens, agent credentials."""
    n = sub.add_parser("nodes", help="list, show, cordon, uncordon nodes")
    n.add_argument("action", choices=("list", "show", "cordon", "uncordon"))
    n.add_argument("name", nargs="?")
    n.add_argument("--state")
    n.add_argument("--reason", default="")
    n.add_argument("--json", action="store_true")
    n.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, help="refresh every S seconds")
    n.set_defaults(fn=cmd_nodes)

    sl = sub.add_parser("slurm", help="Slurm node sync: status, reset the drain breaker (operator)")
    sl.add_argument("action", choices=("status", "reset-breaker"))
    sl.add_argument("--json", action="store_true")
    sl.set_defaults(fn=cmd_slurm)

    _events_parser(sub)

    j = sub.add_parser("jobs", help="start, list, show, stop, checkpoint training jobs")
    j.add_argument("action", choices=("start", "list", "show", "stop", "checkpoint"))
    j.add_argument("rest", nargs="*", help="JOB (show/stop/checkpoint); for start, the entrypoint goes after --")
    j.add_argument("--reason", default="", help="checkpoint: why (recorded in the job's events)")
    j.add_argument("--name")
    j.add_argument("--nodes", type=int, default=1)
    j.add_argument("--gpus-per-node", type=int, default=1)
    j.add_argument("--deepspeed-config", help="a DeepSpeed JSON config file")
    j.add_argument("--env", action="append", default=[], help="KEY=VALUE for the ranks (repeatable)")
    j.add_argument("--selector", action="append", default=[], help="node label KEY=VALUE (repeatable)")
    j.add_argument("--idempotency-key")
    j.add_argument(
        "--backend",
        choices=("agents", "slurm"),
        help="who runs the ranks (default: the orchestrator's PULSE_JOB_BACKEND)",
    )
    j.add_argument("--state")
    j.add_argument("--follow", action="store_true", help="stream state and progress until the job ends")
    j.add_argument("--json", action="store_true")
    j.set_defaults(fn=cmd_jobs)

    pl = sub.add_parser("plan", help="a job's gradient-aggregation plan in force")
    pl.add_argument("job")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    t = sub.add_parser("tokens", help="API tokens: create, list, revoke (admin)")
    t.add_argument("action", choices=("create", "list", "revoke"))
    t.add_argument("name", nargs="?", help="the token (revoke)")
    t.add_argument("--name", dest="name", help="the new token's name (create): the actor of its events")
    t.add_argument("--role", choices=("viewer", "operator", "admin"), help="reads / cordon and jobs / tokens")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_tokens)

    ac = sub.add_parser(
        "agent-credentials",
        help="a node's (or the orchestrator's) Redis ACL user: print or apply the rules and its URL",
    )
    ac.add_argument("node", nargs="?", help="the node whose agent and ranks will use the user")
    ac.add_argument("--orchestrator", action="store_true", help="the orchestrator's user instead of a node's")
    ac.add_argument("--apply", action="store_true", help="ACL SETUSER at PULSE_REDIS_URL (an admin connection)")
    ac.add_argument(
        "--password-file", help="read the password from this file; generate one into it (0600) when it is missing"
    )
    ac.set_defaults(fn=cmd_agent_credentials)


def _tool_commands(sub: Subparsers) -> None:
    """On this machine: the demo, the checks, the benchmarks (:func:`_bench_commands`)."""
    _demo_parser(sub)

    c = sub.add_parser("check", help="self-checks on this machine")
    csub = c.add_subparsers(dest="check", required=True)
    cr = csub.add_parser(
        "reroute",
        help="gloo ranks on this CPU: rerouted DDP against stock DDP (exactness, cost, a hung rank)",
        description="Starts W gloo ranks on this machine, trains a small MLP with and without the plan "
        "(degraded ranks carried by participants, excluded ranks left out) and prints one JSON object. "
        "max_abs_param_diff is against stock DDP over the ranks not excluded. Exit 1 when the check fails.",
    )
    cr.add_argument("--world-size", type=int, default=4, metavar="W", help="ranks to start (default 4)")
    cr.add_argument("--degrade", required=True, metavar="RANK[,RANK]", help="degraded ranks, carried by participants")
    cr.add_argument("--exclude", metavar="RANK[,RANK]", help="excluded ranks (their gradients are left out)")
    cr.add_argument("--hang", type=int, metavar="RANK", help="a degraded RANK that SIGSTOPs itself mid-run")
    cr.add_argument("--steps", type=int, default=10, help="training steps compared for exactness (default 10)")
    cr.add_argument("--repeats", type=int, default=10, help="timed rounds, medians reported (default 10)")
    cr.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048: 16 MiB per layer)")
    cr.add_argument("--layers", type=int, default=8, help="MLP layers (default 8: 128 MiB of gradients)")
    cr.add_argument("--batch", type=int, default=8, help="samples per rank and step (default 8)")
    cr.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, MiB (DDP's default 25)")
    cr.add_argument("--lr", type=float, default=1.0, help="SGD learning rate (default 1.0)")
    cr.add_argument("--proxy-timeout", type=float, default=5.0, help="carrier's wait for a degraded rank, s (5)")
    cr.add_argument("--stock-timeout", type=float, default=20.0, help="timeout of the stock all-reduce hang, s (20)")
    cr.add_argument("--timeout", type=float, default=900.0, help="the whole check, s (default 900)")
    cr.add_argument(
        "--tolerance", type=float, default=1e-3, help="max_abs_param_diff allowed, relative to param_moved (1e-3)"
    )
    cr.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: CPUs / world size)")
    cr.add_argument("--json", action="store_true", help="one JSON object (default: key: value lines)")
    cr.set_defaults(fn=cmd_check)
    _bench_commands(sub)


def _bench_commands(sub: Subparsers) -> None:
    """`pulse bench ...`: ingest, agent, soak, goodput."""
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bi = bsub.add_parser("ingest", help="heartbeat ingest, detection latency and /metrics render")
    bi.add_argument("--nodes", type=int, default=2048)
    bi.add_argument("--gpus-per-node", type=int, default=8)
    bi.add_argument("--duration", type=float, default=10.0)
    bi.add_argument("--silences", type=int, default=64, help="nodes silenced to measure detection")
    bi.add_argument(
        "--interval", type=float, default=0.0, help="heartbeat interval of the detection run, s (0: nodes / 2048, >= 1)"
    )
    bi.add_argument(
        "--processes",
        default="",
        help="the scale-out form: e.g. 0,1,2,4 drains one pre-filled backlog with the leader alone (0) "
        "and with that many ingest processes, side by side (tools/bench_scale.py)",
    )
    bi.add_argument(
        "--ingest-processes",
        type=int,
        default=0,
        help="PULSE_INGEST_PROCESSES of the orchestrator the ingest and detection runs measure (default 0)",
    )
    bi.add_argument(
        "--backlog", type=int, default=0, help="heartbeats pre-filled (scale-out form; 0: 65,536, at least 2 per node)"
    )
    bi.add_argument("--shards", type=int, default=4, help="heartbeat stream shards (scale-out form)")
    bi.add_argument("--json", action="store_true")
    bi.set_defaults(fn=cmd_bench)
    ba = bsub.add_parser("agent", help="agent CPU and memory at a 1 s interval")
    ba.add_argument("--gpus", type=int, default=8)
    ba.add_argument("--duration", type=float, default=30.0)
    ba.add_argument("--interval", type=float, default=1.0)
    ba.add_argument("--json", action="store_true")
    ba.set_defaults(fn=cmd_bench)
    bs = bsub.add_parser(
        "soak",
        help="long run with random faults: orchestrator memory growth, false DEGRADED, lost events",
        description="Starts the orchestrator, N simulated nodes and a private redis-server, injects a fault "
        "of a random kind on a random node every --fault-every seconds for --duration seconds and prints one "
        "JSON object (tools/soak.py). Exit 1 when an event is lost, a node is DEGRADED without a fault, "
        "or resident memory grows more than --max-rss-growth.",
    )
    bs.add_argument("--nodes", type=int, default=2048)
    bs.add_argument("--gpus-per-node", type=int, default=8)
    bs.add_argument("--duration", type=float, default=600.0, help="seconds of faults after the warm-up (600)")
    bs.add_argument("--fault-every", type=float, default=5.0, help="seconds between fault starts (5)")
    bs.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (1)")
    bs.add_argument("--interval", type=float, default=2.0, help="heartbeat interval, s (2)")
    bs.add_argument("--degraded-after", type=float, default=0.0, help="silence before DEGRADED, s (6 x interval)")
    bs.add_argument(
        "--slack",
        type=float,
        default=0.0,
        help="ingest/evaluation lag tolerated on top of each rule, s (4 x interval, >= 5)",
    )
    bs.add_argument("--warmup", type=float, default=60.0, help="seconds after every node is HEALTHY (60)")
    bs.add_argument("--settle-timeout", type=float, default=300.0, help="for every node to be HEALTHY, s (300)")
    bs.add_argument("--max-rss-growth", type=float, default=1.05, help="orchestrator RSS end / warm allowed (1.05)")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(fn=cmd_bench)
    _goodput_command(bsub)


def _goodput_command(bsub: Subparsers) -> None:
    """`pulse bench goodput`: the fault campaign (tools/goodput.py)."""
    bg = bsub.add_parser("goodput", help="a fault campaign against a real stack and a DeepSpeed job: goodput")
    bg.add_argument("--ranks", type=int, default=4, help="simulated nodes, one rank each (default 4)")
    bg.add_argument("--duration", type=float, default=600.0, help="seconds of training per run (default 600)")
    bg.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults (default 15)")
    bg.add_argument("--seed", type=int, default=0, help="seed of the fault draw (default 0)")
    bg.add_argument(
        "--kinds", type=lambda v: [k for k in v.split(",") if k], default=None, help="comma-separated fault kinds"
    )
    bg.add_argument("--cycle", action="store_true", help="take --kinds in turn instead of drawing them")
    bg.add_argument(
        "--collective-timeout",
        type=float,
        default=5.0,
        help="the job's PULSE_COLLECTIVE_TIMEOUT_S: how long survivors wait for a hung or dead peer (default 5)",
    )
    bg.add_argument(
        "--rank-victims",
        type=lambda v: [int(r) for r in v.split(",") if r],
        default=None,
        help="comma-separated ranks rank faults may hit (default: any)",
    )
    bg.add_argument(
        "--fault-free-duration", type=float, default=0.0, help="seconds of the fault-free run (default --duration)"
    )
    bg.add_argument("--out", default=None, help="folder for goodput.json and goodput.png (default: the run's temp dir)")
    bg.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for a job's first step")
    bg.add_argument("--finish-timeout", type=float, default=300.0, help="seconds the faulted job may take to finish")
    bg.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    bg.add_argument(
        "--deepspeed-config",
        default=None,
        help="with --entrypoint: the job's DeepSpeed config (JSON file; default the script's own)",
    )
    bg.add_argument(
        "--entrypoint",
        nargs=argparse.REMAINDER,
        default=None,
        help="SCRIPT|-m MODULE [ARGS...] (last): the script to train instead of trainer.example, run unchanged; "
        "the campaign stops it after the expected steps with PULSE_MAX_STEPS",
    )
    bg.set_defaults(fn=cmd_goodput)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    entry: list[str] = []
    if "--" in argv and "jobs" in argv[: argv.index("--")]:  # pulse jobs start ... -- ENTRYPOINT
        cut = argv.index("--")
        argv, entry = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.entry = entry
    _setup_logging(args.verbose)
    try:
        rc: int = args.fn(args)
    except ValueError as exc:  # bad flags or settings: say what, no traceback
        print(f"pulse: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
    os._exit(0)
