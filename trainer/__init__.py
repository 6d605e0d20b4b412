"""The library a DeepSpeed training script uses: its public API.

A script launched by the agents gets the resilience protocol without a line (``python -m
trainer.run``); one that wants the handle calls :func:`attach` after ``deepspeed.initialize``
(or :func:`current`) and gets a :class:`Resilience`. A script that reroutes by hand (DDP, a
custom loop) builds a :class:`ReroutedAllReduce`, registers :func:`ddp_comm_hook` and follows
the orchestrator's plans with a :class:`PlanFollower`. Every other module is private.

The names load on first use: ``import trainer`` imports neither torch nor DeepSpeed, so
``python -m trainer.run`` checks the job's store before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.collective import ReroutedAllReduce, ddp_comm_hook
    from trainer.deepspeed_reroute import RerouteConfigError
    from trainer.follow import PlanFollower
    from trainer.mfu import model_flops_per_token, peak_flops
    from trainer.report import LossSpikeDetector, StepTimer, TrainerReporter, cosine_warmup
    from trainer.resilience import Resilience, attach, current
    from trainer.route import PlanError, RerouteError, Route, parse_plan, plan_buckets
    from trainer.settings import TrainerSettings, load_trainer_settings

_WHERE = {
    # the resilience protocol on a DeepSpeed engine
    "attach": "trainer.resilience",
    "current": "trainer.resilience",
    "Resilience": "trainer.resilience",
    "RerouteConfigError": "trainer.deepspeed_reroute",
    "TrainerSettings": "trainer.settings",
    "load_trainer_settings": "trainer.settings",
    # reporting
    "TrainerReporter": "trainer.report",
    "StepTimer": "trainer.report",
    "LossSpikeDetector": "trainer.report",
    "cosine_warmup": "trainer.report",
    "model_flops_per_token": "trainer.mfu",
    "peak_flops": "trainer.mfu",
    # rerouting by hand
    "ReroutedAllReduce": "trainer.collective",
    "ddp_comm_hook": "trainer.collective",
    "PlanFollower": "trainer.follow",
    "Route": "trainer.route",
    "parse_plan": "trainer.route",
    "plan_buckets": "trainer.route",
    "PlanError": "trainer.route",
    "RerouteError": "trainer.route",
}

__all__ = [
    "LossSpikeDetector",
    "PlanError",
    "PlanFollower",
    "RerouteConfigError",
    "RerouteError",
    "ReroutedAllReduce",
    "Resilience",
    "Route",
    "StepTimer",
    "TrainerReporter",
    "TrainerSettings",
    "attach",
    "cosine_warmup",
    "current",
    "ddp_comm_hook",
    "load_trainer_settings",
    "model_flops_per_token",
    "parse_plan",
    "peak_flops",
    "plan_buckets",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
