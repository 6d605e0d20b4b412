"""``python -m trainer.run SCRIPT [ARGS...]`` or ``python -m trainer.run -m MODULE [ARGS...]``: run an
unmodified training script with the resilience protocol (:mod:`trainer.resilience`).

The agents start every rank this way; under ``deepspeed`` or ``torchrun`` put it in front of the
script. It runs the script as ``__main__``, then closes the library and leaves with the script's
exit code through ``os._exit``. Before the script runs it installs, with ``PULSE_REDIS_URL`` and
``PULSE_JOB_ID`` set: the rank's registration at its rendezvous and its exit report
(:mod:`trainer.rendezvous`), the world group's collectives over the live ranks
(:mod:`trainer.world`), and a hook on ``deepspeed.initialize`` (:mod:`trainer.imports`) that puts
the job's DeepSpeed config in place of the script's and attaches the library to the first engine.
``PULSE_JOB_STORE=1``: the store at ``MASTER_ADDR:MASTER_PORT`` must name ``PULSE_JOB_ID``
(:mod:`trainer.job_store`). ``PULSE_REJOIN=1``: a world of one before the script starts (the Hugging
Face Trainer adapted to it, :mod:`trainer.frameworks`); under a bare Accelerate loop or Lightning
it replays the loop up to the live ranks' step first (:mod:`trainer.replay`). Details:
``docs/design/resilience.md``.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import ValidationError

from clusterpulse import wire
from trainer import frameworks, job_store, rendezvous, world
from trainer.imports import after_import
from trainer.settings import TrainerSettings, load_trainer_settings

log = logging.getLogger("pulse.trainer.run")

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")
"""Packages that call ``deepspeed.initialize`` for the script: their engines attach; a relaunched
rank is taken back under the Hugging Face Trainer (:mod:`trainer.frameworks`) and, after it
replayed their loops (which count their own steps), under the others (:mod:`trainer.replay`)."""


def _framework(frame: Any) -> str | None:
    """The framework that called ``deepspeed.initialize`` (the Trainer calls it through Accelerate)."""
    found = None
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        package = next((f for f in FRAMEWORKS if name == f or name.startswith(f"{f}.")), None)
        if package == "transformers":
            return package
        found = found or package
        frame = frame.f_back
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    module = args[1] if args[0] == "-m" and len(args) > 1 else None
    if args[0] == "-m" and module is None:
        print("python -m trainer.run -m: expected a module name after -m", file=sys.stderr)
        return 2
    target, rest = (module, args[2:]) if module else (args[0], args[1:])
    assert target is not None
    if not module and not Path(target).is_file():
        print(f"python -m trainer.run {target}: no such script", file=sys.stderr)
        return 2
    try:
        settings = load_trainer_settings()
    except ValidationError as exc:
        print(f"trainer settings (PULSE_*): {exc}", file=sys.stderr)
        return 2
    try:
        job_store.verify(settings)
    except job_store.ForeignStore as exc:
        print(f"python -m trainer.run: {exc}", file=sys.stderr)
        return 1
    if settings.active:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
        install(settings)
    code = _run(target, rest, module=module is not None)
    return _finish(code)


def install(settings: TrainerSettings) -> None:
    """Make this process's ``deepspeed.initialize`` attach the protocol (module docstring)."""
    rendezvous.install(settings)
    world.install()
    frameworks.install_writers()
    if settings.rejoin:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        world.install(alone=world.View(world_size=size, rank=rank, members=(rank,), group=None))
        frameworks.install(rank=rank, world_size=size)
        world_of_one()
    after_import("deepspeed", lambda deepspeed: _patch(deepspeed, settings))


def _patch(deepspeed: ModuleType, settings: TrainerSettings) -> None:
    original: Callable[..., Any] = deepspeed.initialize
    if getattr(original, "_pulse", False):
        return

    def initialize(*args: Any, **kwargs: Any) -> Any:
        from trainer import deepspeed_reroute, resilience

        framework = _framework(sys._getframe(1))
        args, kwargs = _with_job_config(args, kwargs, settings)
        out = original(*args, **kwargs)
        engine = out[0]
        if resilience.current() is not None:
            log.info("event=second_engine_left_alone rank=%s", os.environ.get("RANK"))
        elif getattr(engine, "pipeline_parallelism", False):
            log.warning("event=resilience_refused reason=pipeline_parallelism note=the_plan_numbers_the_whole_world")
        else:
            # the Trainer's step counter takes the live ranks'; the other frameworks' loops replay
            loop = framework is not None and framework != "transformers"
            try:
                resilience.attach(
                    engine, settings=settings, join_at_first_step=framework == "transformers", replay=loop
                )
            except deepspeed_reroute.RerouteConfigError as exc:  # only a relaunched rank raises it
                print(f"python -m trainer.run: a relaunched rank cannot be taken back: {exc}", file=sys.stderr)
                raise SystemExit(wire.REJOIN_REFUSED_EXIT) from None
        return out

    initialize._pulse = True  # type: ignore[attr-defined]
    initialize.__doc__ = original.__doc__
    deepspeed.initialize = initialize  # type: ignore[attr-defined]


def _with_job_config(
    args: tuple[Any, ...], kwargs: dict[str, Any], settings: TrainerSettings
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The config ``deepspeed.initialize`` gets: the job's in place of the script's, made reroutable
    (:func:`reroutable`), with a rejoining rank's batch size for a world of one."""
    cfg: Any = settings.deepspeed_config or None
    ns = kwargs.get("args", args[0] if args else None)
    if cfg is None:
        cfg = kwargs.get("config") or kwargs.get("config_params") or getattr(ns, "deepspeed_config", None)
        if isinstance(cfg, str | Path):
            cfg = json.loads(Path(cfg).read_text())
    if not isinstance(cfg, dict):
        return args, kwargs
    cfg = reroutable(cfg) if settings.reroute else dict(cfg)
    if settings.rejoin:
        cfg = for_world_of_one(cfg)
    kwargs = {**kwargs, "config": cfg}
    kwargs.pop("config_params", None)
    if ns is not None and getattr(ns, "deepspeed_config", None) is not None:  # DeepSpeed refuses a config twice
        ns = copy.copy(ns)
        ns.deepspeed_config = None
        if "args" in kwargs:
            kwargs["args"] = ns
        else:
            args = (ns, *args[1:])
    return args, kwargs


def for_world_of_one(config: dict[str, Any]) -> dict[str, Any]:
    """A relaunched rank's config: DeepSpeed checks ``train_batch_size`` against its world of one,
    so it is the micro batch times the accumulation steps where both are given (a framework
    filled them for the job's world), else the job's divided by the job's world size."""
    out = dict(config)
    micro, steps = out.get("train_micro_batch_size_per_gpu"), out.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(steps, int):
        out["train_batch_size"] = micro * steps
    elif "train_batch_size" in out:
        out["train_batch_size"] = int(out["train_batch_size"]) // int(os.environ.get("WORLD_SIZE", "1"))
    return out


def reroutable(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ZeRO 1-2's gradient reduction in the one method the library reroutes:
    ``reduce_scatter`` false and ``contiguous_gradients`` true where the config leaves them to
    DeepSpeed's defaults (true and true). An all-reduce of each bucket in place of its
    reduce-scatter moves about twice the bytes of the gradient reduction; a config that sets
    ``reduce_scatter: true`` itself is kept, and the rank then reports without rerouting
    (``trainer/deepspeed_reroute.py`` names the setting)."""
    out = dict(config)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and int(zero.get("stage", 0)) in (1, 2):
        out["zero_optimization"] = {"reduce_scatter": False, "contiguous_gradients": True, **zero}
    return out


def world_of_one() -> None:
    """A rejoining rank's own world (module docstring); later init_process_group calls find it made."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore  # torch.distributed re-exports it untyped

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    original = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            original(*args, **kwargs)

    dist.init_process_group = init_process_group
    _rank_in_groups_by_group()


def _rank_in_groups_by_group() -> None:
    """``dist.get_rank(group)`` maps the default group's rank through the group's table of global
    ranks. In a world of one that rank is 0 whatever the rank's place in the job, so in the job's
    groups (:func:`trainer.groups.make_group`, keyed by job ranks) it would name another rank:
    DeepSpeed's ZeRO optimizer asks it which partition is its own. Here it asks the group instead
    (``ProcessGroup.rank()``, the same answer wherever both are right)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.get_rank

    def get_rank(group: dist.ProcessGroup | None = None) -> int:
        if group is None or group is c10d.GroupMember.WORLD or c10d._rank_not_in_group(group):
            return original(group)
        return int(group.rank())

    c10d.get_rank = get_rank
    dist.get_rank = get_rank


def _run(target: str, rest: list[str], *, module: bool) -> int:
    sys.argv = [target, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    from trainer import resilience

    r = resilience.current()
    if r is not None:
        r.close(success=code == 0)
    atexit._run_exitfuncs()
    rendezvous.leave(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
