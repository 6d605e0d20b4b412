"""The on-call subcommands of ``pulse`` (``nodes``, ``slurm``, ``events``, ``jobs``, ``plan``,
``tokens``): an HTTP client of the orchestrator's API (``PULSE_API_URL``, ``PULSE_API_TOKEN``)
and the event stream, rendered by :mod:`tools.format`. An API error exits with its message."""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from clusterpulse.settings import Settings, load_settings
from clusterpulse.states import TERMINAL_JOB_STATES, JobState
from tools.format import (
    format_bottleneck,
    format_event_line,
    format_events,
    format_fabric_check,
    format_jobs,
    format_node,
    format_nodes,
    format_tokens,
    table,
    when,
)


class ApiError(SystemExit):
    pass


def _client(settings: Settings) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    return httpx.Client(base_url=settings.api_url, headers=headers, timeout=10.0)


def _call(method: str, path: str, **kw: Any) -> Any:
    import httpx

    settings = load_settings()
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
    if args.action == "reset-gpu":
        if args.gpu is None:
            raise SystemExit("pulse nodes reset-gpu: NAME and the GPU's INDEX are required")
        asked = _call("POST", f"/v1/nodes/{args.name}/gpus/{args.gpu}/reset", json={})
        print(json.dumps(asked, indent=2) if args.json else f"GPU {args.gpu} of {args.name}: reset asked for "
              f"(request {asked['request']}); `pulse nodes show {args.name}` tells whether it helped")  # fmt: skip
        return 0
    body = {"reason": args.reason} if args.reason else None
    out = _call("POST", f"/v1/nodes/{args.name}/{args.action}", json=body)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        verb = "cordoned" if args.action == "cordon" else "uncordoned"
        print(f"{args.name} {verb}" + ("" if out["changed"] else " (no change: it already was)"))
    return 0


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
        f"drain breaker: {'OPEN since ' + when(st['breaker_since']) + ': ' + st['breaker_reason'] if st['breaker_open'] else 'closed'}"
    )
    print(f"last sync:     {when(st['last_sync_at']) if st['last_sync_at'] else 'never'}  {st['last_error']}")
    print(f"sync errors:   {st['sync_errors']}")
    for node, reason in st["drained_by_clusterpulse"].items():
        print(f"drained by us: {node}  {reason}")
    return 0


def _follow_events(args: argparse.Namespace, since_id: int | None) -> int:
    """``pulse events --follow``: the event stream (GET /v1/stream) after ``since_id``, one line
    (or one JSON object) per event, filtered here by --node/--job; reconnects by itself."""
    from tools.sse import StreamRefused, follow

    settings = load_settings()

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


def _woken_by(wanted: Callable[[dict[str, Any]], bool]) -> queue.Queue[Any]:
    """The events (GET /v1/stream) ``wanted`` accepts, as they come (tools/sse.py ``wake_on``)."""
    from tools.sse import wake_on

    return wake_on(_client(load_settings()), wanted=wanted)


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
        if args.preflight_fabric:
            body["preflight"] = {"fabric": True}
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
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(format_jobs([job]))
    for w in job.get("warnings") or []:
        print(f"  warning: {w}")
    if job.get("bottleneck"):
        print(format_bottleneck(job["bottleneck"]))
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
    print(table(rows))
    return 0


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


def cmd_check_fabric(args: argparse.Namespace) -> int:
    """``pulse check fabric``: start a fabric check, follow it to its verdict, print its pairs and
    the nodes it named slow. Exit 0 when none is slow, 1 when some are, 2 when it did not finish
    within ``--timeout``, 3 when none is slow but some node was not measured (its agent never
    took the probe)."""
    nodes = [n for n in (args.nodes or "").split(",") if n.strip()] or None
    check = _call("POST", "/v1/fabric/checks", json={"nodes": nodes} if nodes else {})
    deadline = time.monotonic() + args.timeout
    while check["state"] != "DONE" and time.monotonic() < deadline:
        time.sleep(args.poll)
        check = _call("GET", f"/v1/fabric/checks/{check['id']}")
    print(json.dumps(check, indent=2) if args.json else format_fabric_check(check))
    if check["state"] != "DONE":
        print(f"pulse check fabric: {check['id']} still runs after {args.timeout:g}s", file=sys.stderr)
        return 2
    return 1 if check["slow"] else 3 if check.get("unmeasured") else 0
