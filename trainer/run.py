"""``python -m trainer.run SCRIPT [ARGS...]`` or ``python -m trainer.run -m MODULE [ARGS...]``: run an
unmodified DeepSpeed script with the resilience protocol (:mod:`trainer.resilience`).

The agents start every rank this way, so a script launched through ``POST /v1/jobs`` changes no
line. With ``deepspeed`` or ``torchrun``, put the runner in front of the script
(``deepspeed --module trainer.run train.py ...``, ``torchrun ... -m trainer.run train.py ...``).

Why a runner and not an import hook in the rank's environment (``sitecustomize``, a ``.pth``):
the runner owns the process's end. It runs the script as ``__main__`` (``runpy``, so ``sys.argv``,
``sys.path[0]`` and ``if __name__ == "__main__"`` are as with ``python script.py``), then closes
the library (the reports are flushed; a restarted rank still waiting to rejoin is told the job is
done), runs the script's ``atexit`` handlers, and leaves with ``os._exit`` and the script's exit
code. gloo's worker threads outlive ``destroy_process_group`` and one that releases the last
collective's tensors during interpreter teardown aborts the process (SIGABRT, exit 134: 3 of 30
rank exits on this machine), which would turn a finished job into a failed one. And nothing is
installed into site-packages or loaded into every Python process of the node.

What the runner does to the script's world, before it runs:

- ``PULSE_JOB_STORE=1`` (the agents and the Slurm batch script set it): the store at
  ``MASTER_ADDR:MASTER_PORT`` must name ``PULSE_JOB_ID`` (:mod:`trainer.job_store`), or the rank
  leaves with exit code 1 and the reason, before torch's rendezvous writes into a stranger's store.

- ``deepspeed.initialize`` is wrapped (when DeepSpeed is imported; nothing is imported early): the
  job's DeepSpeed config (``PULSE_DEEPSPEED_CONFIG``) replaces the script's, and the engine it
  returns gets :func:`trainer.resilience.attach`. Only the first engine is attached (a second one,
  an evaluation engine say, is left alone); a pipeline engine only reports nothing (refused,
  logged: the plan numbers data-parallel ranks of the whole world).
- ``PULSE_REJOIN=1``: the rank cannot enter the live ranks' world (its size was fixed at
  ``init_process_group``), so it gets a world of one before the script starts (DeepSpeed's and
  torch's ``init_process_group`` then find it made), and the config's ``train_batch_size`` is
  divided by the job's world size, as DeepSpeed checks it against a world of one. Its rank in
  the job's groups is asked of the group itself (``dist.get_rank(group)`` would answer from the
  world of one's rank 0).

Without ``PULSE_REDIS_URL`` and ``PULSE_JOB_ID`` the script runs as it would alone.
"""

from __future__ import annotations

import atexit
import copy
import importlib.abc
import importlib.machinery
import importlib.util
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

from trainer import job_store
from trainer.settings import TrainerSettings, load_trainer_settings

log = logging.getLogger("pulse.trainer.run")


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
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
        install(settings)
    code = _run(target, rest, module=module is not None)
    return _finish(code)


def install(settings: TrainerSettings) -> None:
    """Make this process's ``deepspeed.initialize`` attach the protocol (module docstring)."""
    if settings.rejoin:
        world_of_one()
    if "deepspeed" in sys.modules:
        _patch(sys.modules["deepspeed"], settings)
    else:
        sys.meta_path.insert(0, _DeepSpeedFinder(settings))


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Patches ``deepspeed`` right after it is first imported, wherever the import happens."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("deepspeed")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        settings = self.settings

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module, settings)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(deepspeed: ModuleType, settings: TrainerSettings) -> None:
    original: Callable[..., Any] = deepspeed.initialize
    if getattr(original, "_pulse", False):
        return

    def initialize(*args: Any, **kwargs: Any) -> Any:
        from trainer import resilience

        args, kwargs = _with_job_config(args, kwargs, settings)
        out = original(*args, **kwargs)
        engine = out[0]
        if resilience.current() is not None:
            log.info("event=second_engine_left_alone rank=%s", os.environ.get("RANK"))
        elif getattr(engine, "pipeline_parallelism", False):
            log.warning("event=resilience_refused reason=pipeline_parallelism note=the_plan_numbers_the_whole_world")
        else:
            resilience.attach(engine, settings=settings)
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
    if settings.rejoin and "train_batch_size" in cfg:
        cfg["train_batch_size"] = int(cfg["train_batch_size"]) // int(os.environ.get("WORLD_SIZE", "1"))
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
    groups (:func:`trainer.collective.make_group`, keyed by job ranks) it would name another rank:
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
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
