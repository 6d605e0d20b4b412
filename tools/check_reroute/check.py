"""The pure half of ``pulse check reroute``: its configuration, the plans it runs under and the
summary of the ranks' results (what they mean: docs/design/check-reroute.md)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from clusterpulse.wire import Plan

JOB = "check-reroute"
REFERENCE = (
    "stock DDP without faults over the ranks that are not excluded (their data only); excluded ranks are not compared"
)
POLL_S = 0.05
DONE_KEY = "check_reroute/done"  # set by the coordinator once it has every result file


class CheckError(ValueError):
    """A flag with a value the check cannot run with; the message names the flag and the value."""


class CheckFailed(RuntimeError):
    """The ranks did not deliver their results (a rank died, or the check ran past its timeout)."""


# --- Pure parts --------------------------------------------------------------------------------


def parse_ranks(flag: str, text: str | None) -> tuple[int, ...]:
    """``"2,3"`` -> ``(2, 3)``; ``None`` or ``""`` -> ``()`` only when the flag is optional."""
    if text is None:
        return ()
    ranks: list[int] = []
    for part in text.split(","):
        try:
            rank = int(part.strip())
        except ValueError:
            raise CheckError(f"{flag} {text!r}: expected RANK[,RANK] (non-negative integers)") from None
        if rank < 0:
            raise CheckError(f"{flag} {text!r}: rank {rank} is negative")
        if rank in ranks:
            raise CheckError(f"{flag} {text!r}: rank {rank} is listed twice")
        ranks.append(rank)
    return tuple(ranks)


@dataclass(frozen=True)
class CheckConfig:
    """What to check; :meth:`validate` says which flag is wrong. Durations are seconds."""

    world_size: int = 4
    degrade: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    hang: int | None = None
    steps: int = 10
    repeats: int = 10
    hidden: int = 2048
    layers: int = 8
    batch: int = 8
    bucket_mb: float = 25.0
    lr: float = 1.0  # the MSE gradient of a wide MLP is small: this moves the parameters visibly
    proxy_timeout_s: float = 5.0
    stock_timeout_s: float = 20.0
    timeout_s: float = 900.0
    tolerance: float = 1e-3  # of max_abs_param_diff relative to param_moved
    threads: int = 0  # torch threads per rank; 0: this machine's CPUs shared among the ranks
    seed: int = 0

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def live(self) -> tuple[int, ...]:
        """Ranks whose parameters must match the reference: everybody but the excluded."""
        return tuple(r for r in range(self.world_size) if r not in self.exclude)

    def validate(self) -> None:
        w = self.world_size
        if w < 2:
            raise CheckError(f"--world-size {w}: expected at least 2 ranks")
        for flag, ranks in (("--degrade", self.degrade), ("--exclude", self.exclude)):
            for r in ranks:
                if not 0 <= r < w:
                    raise CheckError(f"{flag} {r}: rank outside the world 0..{w - 1} (--world-size {w})")
        if not self.degrade:
            raise CheckError("--degrade: expected at least one rank")
        both = sorted(set(self.degrade) & set(self.exclude))
        if both:
            raise CheckError(f"--degrade/--exclude: rank {both[0]} is both degraded and excluded")
        if len(self.degrade) + len(self.exclude) >= w:
            raise CheckError(
                f"--degrade {_fmt(self.degrade)} --exclude {_fmt(self.exclude)}: every rank of the world of {w} is "
                "degraded or excluded; at least one rank must stay in the all-reduce to carry the others"
            )
        if self.hang is not None and self.hang not in self.degrade:
            raise CheckError(f"--hang {self.hang}: expected one of the degraded ranks {_fmt(self.degrade)}")
        positive_ints = {
            "--steps": self.steps,
            "--repeats": self.repeats,
            "--hidden": self.hidden,
            "--layers": self.layers,
            "--batch": self.batch,
        }
        for flag, n in positive_ints.items():
            if n < 1:
                raise CheckError(f"{flag} {n}: expected at least 1")
        positive = {
            "--bucket-mb": self.bucket_mb,
            "--lr": self.lr,
            "--proxy-timeout": self.proxy_timeout_s,
            "--stock-timeout": self.stock_timeout_s,
            "--timeout": self.timeout_s,
        }
        for flag, x in positive.items():
            if not x > 0:
                raise CheckError(f"{flag} {x}: expected a positive number")
        if self.tolerance < 0:
            raise CheckError(f"--tolerance {self.tolerance}: expected at least 0")
        if self.threads < 0:
            raise CheckError(f"--threads {self.threads}: expected 0 (automatic) or more")


def _fmt(ranks: Iterable[int]) -> str:
    return ",".join(map(str, ranks)) or "''"


def make_plan(world_size: int, degrade: Sequence[int], exclude: Sequence[int], *, generation: int = 1) -> Plan:
    """The plan of the check: each degraded rank carried by the least-loaded participant, nearest
    in ring order (after it) among equals, as the orchestrator's planner does without topology."""
    participants = [r for r in range(world_size) if r not in degrade and r not in exclude]
    load = dict.fromkeys(participants, 0)
    proxies: dict[str, int] = {}
    for d in sorted(degrade):
        carrier = min(participants, key=lambda p: (load[p], (p - d) % world_size))
        load[carrier] += 1
        proxies[str(d)] = carrier
    return Plan(
        job=JOB,
        generation=generation,
        participants=participants,
        proxies=proxies,
        excluded=sorted(exclude),
        reason=f"check: degraded {sorted(degrade)}, excluded {sorted(exclude)}",
    )


def after_hang_plan(plan: Plan, hung: int) -> Plan:
    """What the orchestrator publishes once the carrier reports ``hung`` missing: it is excluded."""
    return Plan(
        job=plan.job,
        generation=plan.generation + 1,
        participants=list(plan.participants),
        proxies={d: c for d, c in plan.proxies.items() if int(d) != hung},
        excluded=sorted([*plan.excluded, hung]),
        reason=f"check: rank {hung} hung",
    )


def _median_of_slowest(results: dict[int, dict[str, Any]], ranks: Iterable[int], key: str) -> float | None:
    """Median over rounds of the slowest of ``ranks`` in each round."""
    series = [results[r][key] for r in ranks if r in results]
    if not series or not series[0]:
        return None
    slowest: list[float] = [max(s[i] for s in series) for i in range(len(series[0]))]
    return statistics.median(slowest)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def _stock_error(errors: list[str | None]) -> str | None:
    """The rank's own timeout if one saw it (the others see their pairs closed by that rank)."""
    seen = [e for e in errors if e]
    return next((e for e in seen if "imed out" in e), seen[0] if seen else None)


def summarize(
    cfg: CheckConfig, plan: Plan, results: dict[int, dict[str, Any]], hang: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The check's one JSON object, from every rank's result file (and the hang files)."""
    out = _figures(cfg, plan, results)
    failures = _failures(cfg, results, out)
    targets: dict[str, Any] = {
        "ratio_le_1.25": out["ratio"] is not None and out["ratio"] <= 1.25,
        "hook_overhead_ratio_le_1.02": out["hook_overhead_ratio"] is not None and out["hook_overhead_ratio"] <= 1.02,
    }
    if cfg.hang is not None:
        _hang_figures(cfg, hang, out, targets, failures)
    out["targets"] = targets
    out["failures"] = failures
    out["ok"] = not failures
    return out


def _figures(cfg: CheckConfig, plan: Plan, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What was run, the exactness figures and the timings (per round the slowest live rank)."""
    live = cfg.live
    carriers = sorted(set(plan.proxies.values()))
    roles = {
        "participant": [r for r in plan.participants if r not in carriers],
        "carrier": carriers,
        "degraded": sorted(int(d) for d in plan.proxies),
    }
    diffs = [results[r]["param_diff"] for r in live]
    moved = min(results[r]["param_moved"] for r in live)
    healthy = _median_of_slowest(results, range(cfg.world_size), "stock_allreduce_s")
    rerouted = _median_of_slowest(results, live, "rerouted_allreduce_s")
    stock_ddp = _median_of_slowest(results, range(cfg.world_size), "stock_ddp_s")
    hook_ddp = _median_of_slowest(results, range(cfg.world_size), "hook_ddp_s")
    rerouted_ddp = _median_of_slowest(results, live, "rerouted_ddp_s")
    any_rank = results[live[0]]
    return {
        "world_size": cfg.world_size,
        "degraded": sorted(cfg.degrade),
        "excluded": sorted(cfg.exclude),
        "plan": {"participants": plan.participants, "proxies": plan.proxies, "excluded": plan.excluded},
        "steps": cfg.steps,
        "repeats": cfg.repeats,
        "model": {
            "hidden": cfg.hidden,
            "layers": cfg.layers,
            "batch": cfg.batch,
            "params": any_rank["params"],
            "grad_bytes": any_rank["grad_bytes"],
        },
        "bucket_mb": cfg.bucket_mb,
        "allreduce_buckets": any_rank["allreduce_buckets"],
        "ddp_buckets": any_rank["ddp_buckets"],
        "threads_per_rank": any_rank["threads"],
        "max_abs_param_diff": max(diffs),
        "param_diff_reference": REFERENCE,
        "param_moved": moved,
        "relative_param_diff": None if not moved else max(diffs) / moved,
        "tolerance": cfg.tolerance,
        "contributors": sorted({c for r in live for c in results[r]["contributors"]}),
        "healthy_allreduce_s": _round(healthy),
        "rerouted_allreduce_s": _round(rerouted),
        "ratio": _ratio(rerouted, healthy),
        "rerouted_allreduce_by_role_s": {
            role: _round(_median_of_slowest(results, ranks, "rerouted_allreduce_s")) for role, ranks in roles.items()
        },
        "stock_ddp_step_s": _round(stock_ddp),
        "hook_ddp_step_s": _round(hook_ddp),
        "hook_overhead_ratio": _ratio(hook_ddp, stock_ddp),
        "rerouted_ddp_step_s": _round(rerouted_ddp),
        "rerouted_ddp_ratio": _ratio(rerouted_ddp, stock_ddp),
        "timing": "per round the slowest live rank, median over rounds; rounds start on a world barrier",
    }


def _failures(cfg: CheckConfig, results: dict[int, dict[str, Any]], out: dict[str, Any]) -> list[str]:
    """What makes the check fail without a hang: parameters that did not move or moved apart,
    a carrier giving up without a fault, a bucket divided by another count than the live ranks."""
    live = cfg.live
    moved, diff = out["param_moved"], out["max_abs_param_diff"]
    failures: list[str] = []
    if not moved:
        failures.append("the parameters did not move: the comparison would be vacuous (raise --lr or --steps)")
    elif not diff <= cfg.tolerance * moved:
        failures.append(
            f"max_abs_param_diff {diff:.3g} exceeds --tolerance {cfg.tolerance:g} x param_moved {moved:.3g}"
        )
    lost = {r: results[r]["missing"] for r in live if results[r]["missing"]}
    if lost:
        failures.append(f"carriers gave up on degraded ranks without a fault: {lost}")
    if out["contributors"] != [len(live)]:
        failures.append(f"bucket divisors {out['contributors']}, expected [{len(live)}] (every live rank)")
    return failures


def _hang_figures(
    cfg: CheckConfig, hang: dict[int, dict[str, Any]], out: dict[str, Any], targets: dict[str, Any], failures: list[str]
) -> None:
    """The hung rank's part: its carrier's step against the bound, what the carrier reported, and
    the stock all-reduce's hang beside it; added to ``out``, ``targets`` and ``failures``."""
    assert cfg.hang is not None
    others = [r for r in range(cfg.world_size) if r != cfg.hang]
    missing = sorted(m for r in others for m in hang.get(r, {}).get("missing", []))
    hung_step = max(hang[r]["hung_step_s"] for r in others)
    stock_ddp = out["stock_ddp_step_s"]
    bound = cfg.proxy_timeout_s + (stock_ddp or 0.0)
    stock_hung = max(hang[r]["stock_hung_step_s"] for r in others)
    out.update(
        {
            "hung_rank": cfg.hang,
            "hung_step_s": _round(hung_step),
            "proxy_timeout_s": cfg.proxy_timeout_s,
            "healthy_step_s": stock_ddp,
            "hung_step_bound_s": _round(bound),
            "carrier_reported_missing": missing,
            "after_hang_step_s": _round(max(hang[r]["after_hang_step_s"] for r in others)),
            "stock_hung_step_s": _round(stock_hung),
            "stock_timeout_s": cfg.stock_timeout_s,
            "stock_hang_error": _stock_error([hang[r]["stock_error"] for r in others]),
        }
    )
    targets["hung_step_le_proxy_timeout_plus_healthy_step"] = hung_step <= bound
    if missing != [cfg.hang]:
        failures.append(f"the carrier reported {missing} missing, expected [{cfg.hang}]")
    if not hung_step < stock_hung:
        failures.append(f"hung_step_s {hung_step:.3f} is not below stock_hung_step_s {stock_hung:.3f}")
    after = sorted({c for r in others for c in hang[r]["after_contributors"]})
    if after != [len(cfg.live) - 1]:
        failures.append(f"bucket divisors after the hang {after}, expected [{len(cfg.live) - 1}]")
