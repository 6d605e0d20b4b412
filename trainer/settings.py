"""Every trainer-side setting, in one object: ``PULSE_*`` environment variables of a rank.

The library (:mod:`trainer.resilience`) reads nothing else from the environment besides what a
launcher sets for torch.distributed (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Build it with :func:`load_trainer_settings`; tests pass their own values as
keyword arguments. Every duration is seconds with an ``_s`` suffix and may be set small for tests.

What each one does (the README's integration section has the same table):

``PULSE_REDIS_URL``, ``PULSE_JOB_ID``
    Where to report and which job this rank belongs to. Both set: reporting, plan following and
    survival are on (the agents set both for every rank they launch). Either unset: the library
    stays out of the way entirely.
``PULSE_COLLECTIVE_TIMEOUT_S`` (60)
    How long a collective of the plan's groups may wait for a participant before the survivors go
    on without it. 0 turns survival off: a dead participant then fails the job as stock DeepSpeed
    would. It bounds what a dead or hung rank costs the survivors (about this plus one step), and
    it must exceed the slowest healthy gradient all-reduce.
``PULSE_PROXY_TIMEOUT_S`` (30)
    How long a carrier waits for its degraded rank's gradient in one step before giving up on it
    and reporting it unreachable.
``PULSE_RECOVERY_TIMEOUT_S`` (120)
    How long survivors wait to agree on a plan without a failed rank (and a restarted rank waits
    to be taken back) before the rank fails.
``PULSE_BEAT_S`` (collective timeout / 10, within 0.05 .. 1)
    The liveness beat each rank writes into the job's store; a missing rank whose beat stood still
    for ``PULSE_SILENT_BEATS`` beats (4) is reported without waiting out the survey.
``PULSE_PLAN_POLL_S`` (1)
    Seconds between reads of the job's plan besides the notifications.
``PULSE_MAX_RECOVERIES`` (3)
    Recoveries in a row without a completed step before the rank gives up and fails.
``PULSE_MAX_STEPS`` (unset)
    Every live rank leaves with exit code 0 at the boundary of this optimizer step, together (the
    step count is agreed); the script's own code after its loop does not run. For benchmarks and
    smoke runs of a script whose length is its own (``pulse bench goodput --entrypoint``).
``PULSE_ZERO_MIRROR_STEPS`` (10)
    ZeRO 1-2: every this many optimizer steps each live rank copies its partition of the
    optimizer state to the live rank ``LOCAL_WORLD_SIZE`` places along (on another node), so that when it is lost the live ranks re-home the
    partition with state at most this many steps old instead of zeros (0: no copy). The master
    weights need no copy: every rank holds the model.
``PULSE_REROUTE`` (true)
    Follow the orchestrator's gradient-aggregation plans (false: reporting only).
``PULSE_REJOIN`` (false)
    This rank was relaunched while the job runs on (the orchestrator sets it): join the live
    ranks at a step boundary and take their state instead of starting a world.
``PULSE_PEAK_FLOPS``, ``PULSE_TOKENS_PER_STEP``, ``PULSE_MODEL_FLOPS_PER_TOKEN``
    What MFU needs and the library cannot always see: the device's peak FLOP/s (a GPU's comes
    from the table in :mod:`trainer.mfu`), the tokens one rank consumes per optimizer step (else
    counted from integer inputs of the engine's forward), and the model's FLOPs per token (else
    ``6 x parameters`` when tokens are counted). Absent means absent: no MFU is invented.
``PULSE_CHECKPOINT_DIR`` (``./pulse-checkpoints``)
    Where an emergency checkpoint (SIGUSR2, ``POST /v1/jobs/{id}/checkpoint``) is written.
``PULSE_JOB_STORE`` (false), ``PULSE_STORE_CONNECT_TIMEOUT_S`` (1800), ``PULSE_STORE_OWNER_WAIT_S`` (10)
    Set by the agents and the Slurm batch script: the store at ``MASTER_ADDR:MASTER_PORT`` is a
    ClusterPulse job store, and ``python -m trainer.run`` checks that it names ``PULSE_JOB_ID``
    before the script runs (:mod:`trainer.job_store`), waiting this long for something to listen
    there (torch's own rendezvous waits 30 minutes) and then for the name.
``PULSE_DEEPSPEED_CONFIG``
    The job's DeepSpeed config as JSON (set by the agents from ``POST /v1/jobs``); when set and
    not empty it is the config ``deepspeed.initialize`` gets, whatever the script passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, Json, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PULSE_", extra="ignore")

    redis_url: str = ""
    job_id: str = ""
    node: str = ""
    collective_timeout_s: float = Field(60.0, ge=0)
    proxy_timeout_s: float = Field(30.0, gt=0)
    recovery_timeout_s: float = Field(120.0, gt=0)
    beat_s: float | None = Field(None, gt=0)
    silent_beats: float = Field(4.0, gt=1)
    plan_poll_s: float = Field(1.0, gt=0)
    max_recoveries: int = Field(3, ge=0)
    max_steps: int | None = Field(None, ge=1)
    zero_mirror_steps: int = Field(10, ge=0)
    reroute: bool = True
    rejoin: bool = False
    peak_flops: float | None = Field(None, gt=0)
    tokens_per_step: int | None = Field(None, ge=0)
    model_flops_per_token: float | None = Field(None, ge=0)
    checkpoint_dir: Path = Path("pulse-checkpoints")
    deepspeed_config: Json[dict[str, Any]] | None = None
    job_store: bool = False
    store_connect_timeout_s: float = Field(1800.0, gt=0)
    store_owner_wait_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if self.rejoin and not (self.survives and self.reroute):
            raise ValueError(
                "PULSE_REJOIN=1 needs PULSE_COLLECTIVE_TIMEOUT_S > 0, PULSE_REROUTE on, PULSE_REDIS_URL and "
                "PULSE_JOB_ID (a rejoining rank follows the live ranks' plans)"
            )
        return self

    @property
    def active(self) -> bool:
        """Reporting (and with it plans and survival) is on: both the Redis URL and the job are known."""
        return bool(self.redis_url and self.job_id)

    @property
    def survives(self) -> bool:
        """A dead or hung participant is survived (collectives bounded by the timeout)."""
        return self.active and self.collective_timeout_s > 0

    @property
    def beat_period_s(self) -> float | None:
        """The liveness beat: ``PULSE_BEAT_S``, else a tenth of the collective timeout within 0.05 .. 1 s."""
        if not self.survives:
            return None
        if self.beat_s is not None:
            return self.beat_s
        return min(1.0, max(0.05, self.collective_timeout_s / 10))


def load_trainer_settings(**overrides: Any) -> TrainerSettings:
    """The rank's settings from ``PULSE_*``; keyword arguments win (tests)."""
    return TrainerSettings(**overrides)
