"""The Slurm node sync (``PULSE_SLURM``): its state, and the operator's reset of the drain breaker."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from services.api.deps import Operator, OrchestratorDep, Viewer
from services.api.schemas import BreakerResetPublic, ErrorPublic, SlurmPublic
from services.orchestrator import Orchestrator

router = APIRouter()


def _slurm(orch: Orchestrator) -> SlurmPublic:
    if orch.slurm is None:
        return SlurmPublic(enabled=False)
    return SlurmPublic(**orch.slurm.status())


@router.get("/v1/slurm", response_model=SlurmPublic)
async def slurm_status(orch: OrchestratorDep, _: Viewer) -> SlurmPublic:
    """The Slurm node sync (``PULSE_SLURM``): the drain breaker, the drains ClusterPulse owns,
    failed commands. A follower answers from its own (idle) copy: ask the leader."""
    return _slurm(orch)


@router.post(
    "/v1/slurm/breaker/reset",
    response_model=BreakerResetPublic,
    responses={409: {"model": ErrorPublic, "description": "Slurm sync is off (PULSE_SLURM)"}},
)
async def reset_breaker(orch: OrchestratorDep, caller: Operator) -> BreakerResetPublic:
    """Close the Slurm drain breaker after looking at why it opened (the
    ``slurm_breaker_open`` event): drains go on, counted afresh from now. Idempotent."""
    if orch.slurm is None:
        raise HTTPException(status.HTTP_409_CONFLICT, detail="Slurm sync is off: set PULSE_SLURM=on to use it")
    changed = await orch.reset_slurm_breaker(actor=caller.name)
    return BreakerResetPublic(slurm=_slurm(orch), changed=changed)
