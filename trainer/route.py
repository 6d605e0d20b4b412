"""The route maths of gradient rerouting, pure: a plan's roles (:class:`Route`,
:func:`parse_plan`), the rank whose state others take after a switch (:func:`state_source`),
DDP-like buckets (:func:`plan_buckets`), the dtype a bucket is reduced in (:func:`reduce_dtype`)
and a carrier's wait budget per step (:class:`StepBudget`). How they are used:
docs/design/collective.md.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from clusterpulse.wire import Plan

Role = Literal["participant", "degraded", "excluded"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Like DDP's default ``bucket_cap_mb=25``."""


class PlanError(ValueError):
    """A plan that does not assign every rank of the world exactly one role."""


class RerouteError(RuntimeError):
    """A degraded rank could not complete its exchange with its carrier.

    Its gradient is not the reduced one: it must not step. The carrier has recorded it as
    missing; the rank comes back only as a new process (``trainer.follow``, ``join``).
    """


# --- Pure parts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A validated plan, in the form the collective uses. Build it with :func:`parse_plan`."""

    job: str
    generation: int
    world_size: int
    participants: tuple[int, ...]
    proxies: tuple[tuple[int, int], ...]  # (degraded, carrier), sorted by degraded rank
    excluded: tuple[int, ...]

    @property
    def trivial(self) -> bool:
        """Nobody degraded or excluded: a stock all-reduce on the world group."""
        return not self.proxies and not self.excluded

    @property
    def root(self) -> int:
        """The rank whose value wins when the ranks agree on something (the lowest participant)."""
        return self.participants[0]

    def role(self, rank: int) -> Role:
        if rank in self.participants:
            return "participant"
        if rank in self.excluded:
            return "excluded"
        return "degraded"

    def carrier_of(self, rank: int) -> int | None:
        return dict(self.proxies).get(rank)

    def carried_by(self, rank: int) -> tuple[int, ...]:
        """The degraded ranks ``rank`` carries, in ascending order."""
        return tuple(d for d, c in self.proxies if c == rank)


def parse_plan(plan: Plan, world_size: int) -> Route:
    """Validate ``plan`` against a world of ``world_size`` ranks or raise :class:`PlanError`.

    Every rank must be exactly one of participant, degraded (a key of ``proxies``) or excluded;
    every carrier must be a participant.
    """
    if world_size < 1:
        raise PlanError(f"world_size={world_size}: expected at least 1")

    def check_ranks(name: str, ranks: Sequence[int]) -> tuple[int, ...]:
        for r in ranks:
            if not 0 <= r < world_size:
                raise PlanError(f"plan.{name}: rank {r} is outside the world 0..{world_size - 1}")
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"plan.{name}={list(ranks)}: a rank is listed twice")
        return tuple(sorted(ranks))

    participants = check_ranks("participants", plan.participants)
    if not participants:
        raise PlanError("plan.participants is empty: expected at least one rank in the all-reduce")
    excluded = check_ranks("excluded", plan.excluded)
    proxies: list[tuple[int, int]] = []
    for key, carrier in plan.proxies.items():
        try:
            degraded = int(key)
        except ValueError:
            raise PlanError(f"plan.proxies: key {key!r} is not a rank number") from None
        if not 0 <= degraded < world_size:
            raise PlanError(f"plan.proxies: degraded rank {degraded} is outside the world 0..{world_size - 1}")
        if carrier not in participants:
            raise PlanError(f"plan.proxies[{key!r}]={carrier}: the carrier must be a participant")
        proxies.append((degraded, carrier))
    proxies.sort()
    degraded_ranks = [d for d, _ in proxies]
    if len(set(degraded_ranks)) != len(degraded_ranks):
        raise PlanError(f"plan.proxies: rank listed twice in {sorted(plan.proxies)}")
    for name, ranks in (("participants", participants), ("excluded", excluded)):
        both = sorted(set(ranks) & set(degraded_ranks))
        if both:
            raise PlanError(f"plan.{name} and plan.proxies both hold ranks {both}")
    both = sorted(set(participants) & set(excluded))
    if both:
        raise PlanError(f"plan.participants and plan.excluded both hold ranks {both}")
    unassigned = sorted(set(range(world_size)) - set(participants) - set(excluded) - set(degraded_ranks))
    if unassigned:
        raise PlanError(f"plan: ranks {unassigned} have no role (neither participants, proxies nor excluded)")
    return Route(
        job=plan.job,
        generation=plan.generation,
        world_size=world_size,
        participants=participants,
        proxies=tuple(proxies),
        excluded=excluded,
    )


def state_source(participants: Sequence[int], returning: Collection[int], degraded: Collection[int] = ()) -> int:
    """Whose state the live ranks take after a switch that brought ``returning`` ranks back: the
    lowest participant not among them (a returning rank 0 is the root again, with nothing to give);
    when every participant is returning, the lowest ``degraded`` rank that is not (carried, but it
    holds the model); the lowest participant only when no live rank has anything to give."""
    kept = [r for r in participants if r not in returning]
    if kept:
        return min(kept)
    carried = [r for r in degraded if r not in returning]
    return min(carried) if carried else min(participants)


def plan_buckets(specs: Sequence[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Group tensors, given as ``(numel, dtype)``, into buckets of one dtype of at most ``bucket_bytes``.

    Tensors keep their order within a bucket; a tensor larger than ``bucket_bytes`` gets a bucket
    of its own. Buckets come in the order of their first tensor. Deterministic, so every rank
    that passes the same shapes gets the same buckets.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: expected a positive number of bytes")
    closed: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, (numel, dtype) in enumerate(specs):
        size = numel * dtype.itemsize
        current = open_.get(dtype)
        if current is not None and current[1] + size > bucket_bytes:
            closed.append(current[0])
            current = None
        if current is None:
            open_[dtype] = ([i], size)
        else:
            current[0].append(i)
            open_[dtype] = (current[0], current[1] + size)
    closed.extend(indexes for indexes, _ in open_.values())
    return sorted(closed, key=lambda b: b[0])


def exact_count_limit(dtype: torch.dtype) -> int:
    """The largest count that ``dtype`` holds, and sums of such counts stay, exactly."""
    return int(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)


def reduce_dtype(dtype: torch.dtype, world_size: int) -> torch.dtype:
    """The dtype a bucket is all-reduced in when a contributor count rides along with it.

    The bucket's own dtype when it counts to ``world_size`` exactly, else float32.
    """
    return dtype if world_size <= exact_count_limit(dtype) else torch.float32


class StepBudget:
    """How long a carrier may still wait for each degraded rank in this step.

    Each peer's budget of ``timeout_s`` starts at the first question about it, and is shared by
    all of that peer's buckets: a slow rank costs at most ``timeout_s`` per step in total.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline: dict[int, float] = {}

    def remaining(self, peer: int, now: float) -> float:
        deadline = self._deadline.setdefault(peer, now + self.timeout_s)
        return max(0.0, deadline - now)
