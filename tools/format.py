"""How the ``pulse`` command, the demo and its training job render the orchestrator's answers:
plain-text tables and event lines (``--json`` prints the answers as they are)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


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
    return table(rows)


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"


def format_events(events: Sequence[dict[str, Any]]) -> str:
    rows = [("TIME", "KIND", "NODE", "CHANGE", "ACTOR", "REASON")]
    for e in events:
        change = f"{e['from_state']} -> {e['to_state']}" if e["to_state"] else ""
        rows.append((when(e["at"]), e["kind"], e["node"] or "-", change, e["actor"], e["reason"][:100]))
    return table(rows)


def format_node(n: dict[str, Any]) -> str:
    lines = [
        f"{n['name']}  {n['state']}  since {when(n['state_since'])}  {'schedulable' if n['schedulable'] else 'NOT SCHEDULABLE (' + _sched(n) + ')'}",
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
    rows = [("GPU", "STATE", "NAME", "UTIL", "TEMP", "POWER", "PCIE", "THROTTLE", "ECC-U", "XID")]
    for g in n["gpus"]:
        state = g.get("state", "HEALTHY") + (" (reset due)" if g.get("reset_due") else "")
        if g.get("lost"):
            rows.append((str(g["index"]), state, "LOST", "-", "-", "-", "-", "-", "-", g.get("error") or ""))
            continue
        rows.append(
            (
                str(g["index"]),
                state,
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
    lines.append(table(rows))
    lines += [f"  GPU {g['index']}:     {g['state']}: {g['reason']}" for g in n["gpus"] if g.get("reason")]
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
        lines.append(table(prow))
    if n.get("nics"):
        lines.append(table(_port_rows(n["nics"])))
    return "\n".join(lines)


def _port_rows(ports: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """A node's network ports: state, rate, nearest GPU, and what its error counters counted over
    the agent's error window (docs/design/fabric.md)."""
    rows: list[tuple[str, ...]] = [("PORT", "STATE", "PHYS", "RATE", "GPU", "NETDEV", "ERRORS")]
    for p in ports:
        errors = ",".join(f"{c}+{v}" for c, v in sorted((p.get("errors") or {}).items())) or "-"
        rows.append(
            (
                f"{p['device']}/{p['port']}",
                "MISSING" if p.get("missing") else p.get("state") or "-",
                p.get("phys_state") or "-",
                f"{p['rate_gbps']:g} Gb/s" if p.get("rate_gbps") else "-",
                "-" if p.get("gpu") is None else str(p["gpu"]),
                p.get("netdev") or "-",
                errors,
            )
        )
    return rows


def format_event_line(e: dict[str, Any]) -> str:
    change = f"{e['from_state']} -> {e['to_state']}" if e["to_state"] else ""
    return "  ".join(x for x in (when(e["at"]), e["kind"], e["node"] or "-", change, e["actor"], e["reason"]) if x)


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
    return table(rows)


def format_bottleneck(b: dict[str, Any]) -> str:
    """A job's step verdict over its last window, and where each rank's step went (docs/design/step.md)."""
    where = (
        f" rank {b['rank']} on {b['node']}"
        if b.get("rank") is not None
        else f" node {b['node']}"
        if b.get("node")
        else ""
    )
    phases = ("data", "forward", "backward", "communication", "optimizer")
    lines = [f"  bottleneck: {b['kind']}-bound{where} ({b['window_s']:g} s window): {b['reason']}"]
    rows = [["RANK", "NODE", "STEPS", *(p.upper() for p in phases), "WAIT"]]
    for rank, r in sorted(b["ranks"].items(), key=lambda kv: int(kv[0])):
        rows.append([rank, r["node"], str(r["steps"]), *(f"{r[p]:.3g}" for p in phases), f"{r['wait']:.3g}"])
    lines.append(table(rows))
    return "\n".join(lines)


def format_tokens(tokens: Sequence[dict[str, Any]]) -> str:
    rows = [("NAME", "ROLE", "STATE", "CREATED", "BY", "REVOKED")]
    for t in tokens:
        revoked = f"{when(t['revoked_at'])} by {t['revoked_by']}" if t["revoked_at"] is not None else "-"
        state = "active" if t["active"] else "revoked"
        rows.append((t["name"], t["role"], state, when(t["created_at"]), t["created_by"], revoked))
    return table(rows)


def format_fabric_check(c: dict[str, Any]) -> str:
    """A fabric check: every pair's bus bandwidth, then the verdict and each slow node's reason."""
    rows = [
        [str(p["round"]), " - ".join(p["nodes"]), p["state"],
         "-" if p.get("busbw_gbps") is None else f"{p['busbw_gbps']:.3g}", p.get("detail", "")]
        for p in c["pairs"]
    ]  # fmt: skip
    lines = [
        f"fabric check {c['id']} {c['state']}: {c['reason']}",
        table([["ROUND", "PAIR", "STATE", "BUSBW GB/s", "DETAIL"], *rows]),
    ]
    lines += [f"slow: {node}: {c['slow_reasons'].get(node, '')}" for node in c["slow"]]
    lines += [f"not measured: {node}: {why}" for node, why in sorted((c.get("unmeasured") or {}).items())]
    return "\n".join(lines)
