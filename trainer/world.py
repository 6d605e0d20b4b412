"""Collectives on the world group, run over the live ranks once a plan is in force.

Frameworks (the Hugging Face Trainer, Accelerate, Lightning) and scripts run collectives of their
own on the default group: a loss gathered for a log line, a barrier around a checkpoint, an
evaluation's gathers. :func:`install` (the runner calls it) wraps ``torch.distributed``'s
collectives so that, while a :class:`View` is in force (the attached library's, with survival
on), a call on the world group runs on the view's group, each slot of a rank outside it filled by
its stand-in (:mod:`trainer.stand_ins`). Rank and world size stay the script's own, so samplers
and logging keep working. Per collective:

- ``all_reduce``, ``reduce``: a live rank's value counts once per slot it fills (SUM, AVG, PRODUCT,
  BXOR weighted; MAX, MIN, BAND, BOR as they are); a reduce to a rank outside does nothing.
- ``all_gather`` (list or one tensor), ``gather`` and the object forms: the stand-in's entry in
  each slot of a rank outside; a gather to a rank outside does nothing. An output sized for a
  world of one (a relaunched rank's process group) gets the rank's own entry.
- ``reduce_scatter`` (list or one tensor): each live rank gets its own slot, reduced as above.
- ``broadcast``, ``scatter`` and their object forms from a live rank as usual; from a rank outside
  they raise :class:`ExcludedSource`. ``barrier``: over the live ranks.
- A relaunched rank not yet taken back runs them alone (:attr:`View.alone`): a broadcast or
  scatter from another rank leaves its tensor as it is (its own value stands in for the source's:
  Accelerate's data loader broadcasts rank 0's random state at each epoch, identical on every rank
  of a script that seeds them alike).

A failed collective is not raised into the script: :meth:`trainer.resilience.Resilience.survive`
recovers and it runs again over the new view, from its inputs as they were (docs/design/rerouting.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from trainer.imports import after_import
from trainer.stand_ins import stand_ins, weights


class ExcludedSource(RuntimeError):
    """A broadcast or scatter from a rank the plan in force left out: it has nothing to send."""


@dataclass(frozen=True)
class View:
    """Who takes part in the world's collectives now: ``members`` (job ranks, ascending) on
    ``group`` (None: this process's default group, for a view of this rank alone)."""

    world_size: int
    rank: int
    members: tuple[int, ...]
    group: dist.ProcessGroup | None

    @functools.cached_property
    def table(self) -> tuple[int, ...]:
        return stand_ins(self.world_size, self.members)

    @property
    def weight(self) -> int:
        return weights(self.table)[self.rank]

    def index(self, rank: int) -> int:
        return self.members.index(rank)

    @property
    def alone(self) -> bool:
        """A relaunched rank not yet taken back, running the world's collectives by itself."""
        return self.members == (self.rank,) and self.group is None


Provider = Callable[[], View | None]
Survive = Callable[[RuntimeError], None]


def _alone_view() -> View | None:
    return _alone


def _raise(error: RuntimeError) -> None:
    raise error


_provider: Provider = _alone_view
_survive: Survive = _raise
_alone: View | None = None
_originals: dict[str, Callable[..., Any]] = {}


def install(*, view: Provider | None = None, survive: Survive | None = None, alone: View | None = None) -> None:
    """Wrap the world group's collectives (now, or once ``torch.distributed`` is imported), with
    the callbacks of :func:`use`. ``alone``: the view until a library attaches (a relaunched rank's,
    whose process group is a world of one); None: the world group itself."""
    global _alone
    if alone is not None:
        _alone = alone
    use(view=view, survive=survive)
    after_import("torch.distributed", _wrap_all)


def use(*, view: Provider | None, survive: Survive | None) -> None:
    """Who takes part now (``view``; the library's, once it attaches: :meth:`Resilience.world_view`)
    and what a failed collective does before it runs again (``survive``: recover, or raise)."""
    global _provider, _survive
    if view is not None:
        _provider = view
    if survive is not None:
        _survive = survive


def stands_in_for_rank_zero() -> bool:
    """This rank does rank 0's writing now: a plan in force leaves rank 0 out and this rank is its
    stand-in (what fills rank 0's slot). Never a rank alone (a relaunched rank not yet taken back).
    The view makes the live ranks' group at first use; when that fails (a rank died meanwhile) the
    answer is no, and the next collective recovers as usual."""
    try:
        view = _provider()
    except RuntimeError:
        return False
    if view is None or view.group is None or 0 in view.members:
        return False
    return view.table[0] == view.rank


def original(name: str) -> Callable[..., Any]:
    """The unwrapped ``torch.distributed`` function ``name``."""
    return _originals.get(name) or getattr(dist.distributed_c10d, name)


def _wrap_all(module: ModuleType) -> None:
    c10d = module.distributed_c10d
    for name, impl in _IMPLS.items():
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_pulse", False):
            continue
        _originals[name] = fn
        wrapped = _wrapper(name, fn, impl)
        setattr(c10d, name, wrapped)
        if getattr(module, name, None) is fn:
            setattr(module, name, wrapped)


def _is_world(group: object) -> bool:
    return group is None or group is dist.GroupMember.WORLD


def _wrapper(name: str, fn: Callable[..., Any], impl: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    at = list(sig.parameters).index("group")
    default = sig.parameters["group"].default

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        group = kwargs["group"] if "group" in kwargs else args[at] if len(args) > at else default
        if not _is_world(group):
            return fn(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        async_op = bool(call.pop("async_op", False))
        del call["group"]
        inputs = _inputs(name, call)
        saved: list[torch.Tensor] | None = None
        while True:
            try:
                view = _provider()  # may make the view's group: a rendezvous that can fail too
                if view is None:
                    return fn(*args, **kwargs)
                saved = saved if saved is not None else [t.clone() for t in inputs]
                out = impl(view, **call)
                break
            except ExcludedSource:
                raise
            except RuntimeError as exc:
                for t, s in zip(inputs, saved or [], strict=False):
                    t.copy_(s)
                _survive(exc)  # raises when the rank cannot go on
        return _Done(out) if async_op else out

    wrapped._pulse = True  # type: ignore[attr-defined]
    return wrapped


def _inputs(name: str, call: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a failed try may have overwritten, restored before the next try."""
    if name in ("all_reduce", "reduce", "broadcast"):
        return [call["tensor"]]
    return []


class _Done:
    """The work object of an asynchronous call that already completed."""

    def __init__(self, out: Any) -> None:
        self._out = out

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(self._out)
        return fut


# --- the collectives over a view ------------------------------------------------------------------

_WEIGHTED = {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.BXOR}


def _weigh(t: torch.Tensor, op: Any, weight: int) -> None:
    """``t`` as the contribution of ``weight`` slots holding it (in place)."""
    if weight == 1 or op not in _WEIGHTED:
        return
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        t.mul_(weight)
    elif op == ReduceOp.PRODUCT:
        t.pow_(weight)
    elif weight % 2 == 0:  # BXOR: an even count of one value cancels out
        t.zero_()


def _reduce_op(op: Any) -> Any:
    return ReduceOp.SUM if op == ReduceOp.AVG else op  # gloo has no AVG: a SUM, divided below


def _all_reduce(view: View, *, tensor: torch.Tensor, op: Any) -> None:
    _weigh(tensor, op, view.weight)
    original("all_reduce")(tensor, op=_reduce_op(op), group=view.group)
    if op == ReduceOp.AVG:
        tensor.div_(view.world_size)


def _reduce(view: View, *, tensor: torch.Tensor, dst: int | None, op: Any, group_dst: int | None, **_: Any) -> None:
    dst = dst if dst is not None else group_dst
    if dst not in view.members:
        return
    _weigh(tensor, op, view.weight)
    original("reduce")(tensor, op=_reduce_op(op), group=view.group, group_dst=view.index(dst))
    if op == ReduceOp.AVG and view.rank == dst:
        tensor.div_(view.world_size)


def _broadcast(view: View, *, tensor: torch.Tensor, src: int | None, group_src: int | None, **_: Any) -> None:
    src = src if src is not None else group_src
    if view.alone:
        return  # its own source: the tensor as it is
    if src not in view.members:
        raise ExcludedSource(
            f"broadcast from rank {src}: the plan in force left it out of the job (live ranks {list(view.members)})"
        )
    original("broadcast")(tensor, group=view.group, group_src=view.index(src))


def _gather_live(view: View, tensor: torch.Tensor) -> list[torch.Tensor]:
    live = [torch.empty_like(tensor) for _ in view.members]
    original("all_gather")(live, tensor.contiguous(), group=view.group)
    return live


def _fill(view: View, slots: list[torch.Tensor], live: list[torch.Tensor]) -> None:
    """Each slot its holder's entry; a caller that sized its output by its own process group, a
    relaunched rank's world of one, gets its own entry."""
    table = view.table if len(slots) == view.world_size or len(slots) != 1 else (view.rank,)
    for slot, holder in zip(slots, table, strict=True):
        slot.copy_(live[view.index(holder)])


def _all_gather(view: View, *, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    _fill(view, tensor_list, _gather_live(view, tensor))


def _all_gather_single(view: View, *, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
    live = _gather_live(view, input_tensor)
    slots = list(output_tensor.view(output_tensor.numel() // max(1, input_tensor.numel()), -1).unbind(0))
    _fill(view, slots, [t.reshape(-1) for t in live])


def _gather(
    view: View,
    *,
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int | None,
    group_dst: int | None,
    **_: Any,
) -> None:
    dst = dst if dst is not None else group_dst
    if dst not in view.members:
        return
    live = [torch.empty_like(tensor) for _ in view.members] if view.rank == dst else None
    original("gather")(tensor, live, group=view.group, group_dst=view.index(dst))
    if live is not None and gather_list is not None:
        _fill(view, gather_list, live)


def _scatter(
    view: View,
    *,
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    src: int | None,
    group_src: int | None,
    **_: Any,
) -> None:
    src = src if src is not None else group_src
    if view.alone and src != view.rank:
        return  # nothing sent to it: its tensor as it is
    if src not in view.members:
        raise ExcludedSource(
            f"scatter from rank {src}: the plan in force left it out of the job (live ranks {list(view.members)})"
        )
    live = [scatter_list[r] for r in view.members] if view.rank == src and scatter_list is not None else None
    original("scatter")(tensor, live, group=view.group, group_src=view.index(src))


def _reduce_scatter(view: View, *, output: torch.Tensor, input_list: list[torch.Tensor], op: Any) -> None:
    whole = torch.stack([t.reshape(-1) for t in input_list])
    _all_reduce(view, tensor=whole, op=op)
    output.copy_(whole[view.rank].view_as(output))


def _reduce_scatter_single(view: View, *, output: torch.Tensor, input: torch.Tensor, op: Any) -> None:
    whole = input.detach().clone().view(view.world_size, -1)
    _all_reduce(view, tensor=whole, op=op)
    output.copy_(whole[view.rank].view_as(output))


def _barrier(view: View, **_: Any) -> None:
    original("barrier")(group=view.group)


_IMPLS: dict[str, Callable[..., Any]] = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_single": _all_gather_single,
    "all_gather_into_tensor": _all_gather_single,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_single": _reduce_scatter_single,
    "reduce_scatter_tensor": _reduce_scatter_single,
    "barrier": _barrier,
}
