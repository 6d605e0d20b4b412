"""Every trainer-side setting, in one object: the ``PULSE_*`` environment variables of a rank.

The library reads nothing else from the environment besides what a launcher sets for
torch.distributed (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). Build it with :func:`load_trainer_settings`; tests pass their own values as
keyword arguments. Every duration is seconds with an ``_s`` suffix and may be set small for tests.
``PULSE_REDIS_URL`` and ``PULSE_JOB_ID`` both set turn reporting, plan following and survival on;
either unset, the library stays out of the way. What each setting means, with its default:
docs/configuration.md, "Each training rank" (a test keeps that table complete).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, Json, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PULSE_", extra="ignore")

    redis_url: str = ""
    redis_cluster: bool = False  # PULSE_REDIS_URL names a node of a Redis Cluster (set by the agent)
    job_id: str = ""
    node: str = ""
    collective_timeout_s: float = Field(60.0, ge=0)
    proxy_timeout_s: float = Field(30.0, gt=0)
    recovery_timeout_s: float = Field(120.0, gt=0)
    beat_s: float | None = Field(None, gt=0)
    silent_beats: float = Field(4.0, gt=1)
    hang_watch: bool = True
    hang_silence_s: float = Field(2.0, gt=0)
    plan_poll_s: float = Field(1.0, gt=0)
    max_recoveries: int = Field(3, ge=0)
    max_steps: int | None = Field(None, ge=1)
    zero_mirror_steps: int = Field(10, ge=0)
    reroute: bool = True
    step_phases: bool = True
    rejoin: bool = False
    peak_flops: float | None = Field(None, gt=0)
    tokens_per_step: int | None = Field(None, ge=0)
    model_flops_per_token: float | None = Field(None, ge=0)
    checkpoint_dir: Path = Path("pulse-checkpoints")
    divergence_factor: float = Field(10.0, ge=0)
    divergence_window: int = Field(100, ge=1)
    divergence_cooldown_steps: int = Field(100, ge=0)
    update_ratio_every: int = Field(10, ge=0)
    deepspeed_config: Json[dict[str, Any]] | None = None
    job_store: bool = False
    store_connect_timeout_s: float = Field(1800.0, gt=0)
    store_owner_wait_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if 0 < self.divergence_factor <= 1:
            raise ValueError(f"PULSE_DIVERGENCE_FACTOR={self.divergence_factor:g}: expected 0 (off) or above 1")
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
        """The liveness beat: ``PULSE_BEAT_S``, else a tenth of the collective timeout within
        0.05 .. 0.5 s (four beats or more in ``PULSE_HANG_SILENCE_S``: ``trainer.hang``)."""
        if not self.survives:
            return None
        if self.beat_s is not None:
            return self.beat_s
        return min(0.5, max(0.05, self.collective_timeout_s / 10))


def load_trainer_settings(**overrides: Any) -> TrainerSettings:
    """The rank's settings from ``PULSE_*``; keyword arguments win (tests)."""
    return TrainerSettings(**overrides)
