"""One settings object per process, from ``PULSE_*`` environment variables.

Build it with :func:`load_settings` (tests pass their own values as keyword arguments). Every
duration is a float of seconds with a ``_s`` suffix and can be set small for tests.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from clusterpulse.wire import ADDR_PATTERN


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PULSE_", extra="forbid")

    env: Literal["development", "production"] = "development"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # A Redis Cluster: PULSE_REDIS_URL names any of its nodes (clusterpulse/redis_client.py,
    # docs/design/redis-cluster.md); off, the one Redis at PULSE_REDIS_URL
    redis_cluster: bool = False
    database_url: str = "sqlite:///clusterpulse.db"
    api_url: str = "http://127.0.0.1:8000"
    api_token: str = ""  # the bootstrap admin token, named "env" (services/api/tokens.py)
    # Which reads need a viewer token: GET /v1/... (default: in production only), /metrics, and
    # /healthz + /readyz (default open, for Prometheus and probes that carry no token).
    auth_reads: bool | None = None
    auth_metrics: bool = False
    auth_health: bool = False
    token_cache_s: float = Field(5.0, ge=0)  # how long a token lookup is reused (0: never)
    redis_timeout_s: float = Field(5.0, gt=0)
    max_body_bytes: int = Field(256 * 1024, ge=1024)
    # Mutating calls (POST) per caller (token name + client address): a token bucket refilled at
    # rate_limit_per_s holding at most rate_limit_burst; either at 0 switches limiting off
    # (services/api/ratelimit.py).
    rate_limit_per_s: float = Field(10.0, ge=0)
    rate_limit_burst: int = Field(100, ge=0)

    # Heartbeats
    heartbeat_interval_s: float = Field(30.0, gt=0)
    heartbeat_ttl_s: float | None = Field(None, gt=0)  # latest-key TTL; default 3 x degraded_after
    heartbeat_stream_shards: int = Field(1, ge=1, le=1024)
    heartbeat_stream_maxlen: int = Field(200_000, ge=1000)
    # Refuse a stream heartbeat its node's own latest key does not vouch for (clusterpulse/acl.py)
    heartbeat_sender_check: bool = True

    # Agent sources
    ipmi_command: str = "ipmitool sdr elist"
    ipmi_interval_s: float = Field(30.0, gt=0)
    ipmi_timeout_s: float = Field(10.0, gt=0)
    xid_window_s: float = Field(300.0, gt=0)
    # Network ports (agent/nics.py): the root under which /sys and /proc are read (tests point it
    # at a fake tree laid out like a real node's), and the two trailing windows each counter's
    # increase is published over (wire.NicPort: ``recent`` for the per-second and per-minute rules,
    # ``errors`` for the per-hour ones and for any increase of a link-down counter)
    sysfs_root: str = "/"
    nic_rate_window_s: float = Field(60.0, gt=0)
    nic_error_window_s: float = Field(3600.0, gt=0)
    # Tests only (tests/faults): seconds added to the time the agent stamps on its heartbeats
    # (``sent_at``), a node whose clock is off. Health never reads that time; it is only reported.
    agent_clock_offset_s: float = 0.0

    # Health policy (see services/health/decide.py)
    suspect_after_s: float | None = Field(None, gt=0)  # default 2 x heartbeat interval
    degraded_after_s: float = Field(120.0, gt=0)
    lost_after_s: float = Field(300.0, gt=0)
    recover_after: int = Field(3, ge=1)
    partition_fraction: float = Field(0.5, gt=0, le=1)
    throttle_sustain_s: float = Field(60.0, ge=0)
    gpu_temperature_warn_celsius: float = 87.0
    psu_output_imbalance_amperes: float = Field(8.0, gt=0)
    psu_input_imbalance_amperes: float = Field(1.5, gt=0)
    gpu_power_peer_gap_ratio: float = Field(0.05, gt=0, lt=1)
    # Network ports (services/health/nics.py, docs/design/fabric.md): the rate every port should
    # run at (0: a node label ``nic_rate_gbps``, else the rate most of the node's ports of the same
    # model run at); error rates over the agent's windows; heartbeats a port may be missing from
    # sysfs before it counts as gone; and the netdev rate with flat RDMA data that means TCP
    nic_expected_rate_gbps: float = Field(0.0, ge=0)
    nic_symbol_error_warn_per_s: float = Field(10.0, ge=0)
    nic_symbol_error_fatal_per_hour: float = Field(120.0, ge=0)
    nic_link_error_recovery_per_min: float = Field(5.0, ge=0)
    nic_port_rcv_errors_per_s: float = Field(10.0, ge=0)
    nic_port_xmit_discards_per_s: float = Field(100.0, ge=0)
    nic_missing_heartbeats: int = Field(3, ge=1)
    nic_tcp_bytes_per_s: float = Field(50e6, gt=0)
    # The fabric check (services/fabric/decide.py, docs/design/fabric.md): a pair below this
    # fraction of the median pair, or below the floor (0: none), is slow; what a probe moves per
    # all-reduce and how often; how long a probe may take; how long a node named slow stays
    # SUSPECT; the extra nodes a preflighted job's check takes along to swap in for slow ones
    fabric_slow_fraction: float = Field(0.7, gt=0, lt=1)
    fabric_min_busbw_gbps: float = Field(0.0, ge=0)
    fabric_probe_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    fabric_probe_iters: int = Field(20, ge=1)
    fabric_probe_timeout_s: float = Field(120.0, gt=0)
    fabric_suspect_s: float = Field(3600.0, gt=0)
    fabric_preflight_spares: int = Field(2, ge=0)

    # Gradient aggregation plans (services/plans/decide.py)
    max_proxied_per_rank: int = Field(1, ge=1)

    # Training progress (services/jobs/progress.py)
    straggler_factor: float = Field(1.5, gt=1)
    job_stale_after_s: float = Field(300.0, gt=0)
    # The step's breakdown (services/jobs/bottleneck.py, breakdown.py; docs/design/step.md): a
    # verdict per window; a rank or node stands out at factor x its peers' median and min_excess of
    # the step; data or communication bind the whole job at share of the step; a node named for
    # communication suspect_windows windows in a row is SUSPECT for bottleneck_suspect_s.
    bottleneck_window_s: float = Field(60.0, gt=0)
    bottleneck_factor: float = Field(2.0, gt=1)
    bottleneck_min_excess: float = Field(0.1, ge=0, lt=1)
    bottleneck_share: float = Field(0.3, gt=0, le=1)
    bottleneck_suspect_windows: int = Field(2, ge=1)
    bottleneck_suspect_s: float = Field(600.0, gt=0)

    # Jobs (services/jobs/decide.py, agent/launcher.py)
    # Launch sent -> every rank rendezvoused (registered or reported a step, services/jobs/decide.py);
    # a job still short of that after this long FAILS and its ranks are stopped.
    job_start_timeout_s: float = Field(300.0, gt=0)
    job_stop_grace_s: float = Field(10.0, ge=0)
    # A rank process none of whose threads can run (stopped, uninterruptible) this long is hung (0: never)
    hang_after_s: float = Field(1.0, ge=0)
    job_resend_s: float = Field(5.0, gt=0)
    job_max_rejoins: int = Field(10, ge=0)  # relaunches per node and job of excluded ranks (0: never)
    # Job commands (wire.JobCommand, agent/current.py): a launch or checkpoint is acted on only for
    # this long after it was sent (its not_after; launches are resent while a job starts); a
    # restarted agent starts nothing older. A command stream keeps at most job_commands_maxlen
    # entries and none older than job_commands_max_age_s, except that a command still current
    # (younger than job_command_ttl_s) is never trimmed (services/leader.py, FENCED_COMMANDS).
    job_command_ttl_s: float = Field(120.0, gt=0)
    job_commands_maxlen: int = Field(10_000, ge=1)
    job_commands_max_age_s: float = Field(86_400.0, gt=0)
    agent_state_dir: str = ""  # <dir>/<node>; default $XDG_STATE_HOME or ~/.local/state, /clusterpulse/<node>
    job_master_addr_label: str = "addr"  # a node label that, when set, overrides the address its agent publishes
    # A job's rendezvous port (its store's, on its first node): one of base ... base + span - 1 that
    # no other active job at the same address holds (services/jobs/decide.py, master_port)
    job_port_base: int = Field(29500, ge=1, le=65535)
    job_port_span: int = Field(500, ge=1)
    # How long the first node's agent (and the Slurm batch script) waits for the job's store to
    # listen at the job's port before it fails the node's launch (agent/launcher.py). A store whose
    # port is held exits at once; this bounds only a slow start (it imports torch: 10 s was too
    # short on a loaded node, and failed a healthy job)
    job_store_ready_timeout_s: float = Field(60.0, gt=0)
    # A job's store outlives its agent (a restarted one adopts it) but not for good: it leaves once no
    # live agent has kept it for this long (agent/store_keeper.py); it looks every job_store_poll_s.
    job_store_orphan_grace_s: float = Field(300.0, gt=0)
    job_store_poll_s: float = Field(1.0, gt=0)
    # The address this node's peers reach it at (the rendezvous of a job whose first node it is),
    # published in the heartbeat; empty: the agent finds it itself (agent/address.py)
    agent_addr: str = Field("", pattern=ADDR_PATTERN)

    # Orchestrator loops
    evaluate_interval_s: float = Field(0.5, gt=0)
    evaluate_slice_nodes: int = Field(2048, ge=0)  # nodes evaluated between turns of the event loop (0: all)
    metrics_slice_nodes: int = Field(256, ge=0)  # nodes a /metrics render writes between turns of the loop (0: all)
    metrics_slice_pause_s: float = Field(0.005, ge=0)  # the loop's other work between two slices of a render
    loop_watch_interval_s: float = Field(0.1, gt=0)  # how often the event loop's lag is measured
    gc_thaw_s: float = Field(600, ge=0)  # frozen objects handed back (services/freeze.py); 0: none frozen
    ingest_block_s: float = Field(0.2, gt=0)
    ingest_batch: int = Field(2000, ge=1)
    # Ingest processes (services/ingest/worker.py) per replica: 0 (the default) has the leader read
    # the heartbeat streams itself; N > 0 starts N processes that read them and hand the leader
    # observations, for clusters one process cannot follow (services/ingest/observations.py).
    ingest_processes: int = Field(0, ge=0, le=64)
    # An entry an ingest process read and did not hand over within this long (killed, hung) is
    # claimed by another; also how long a dead process's entries wait.
    ingest_claim_s: float = Field(5.0, gt=0)
    persist_interval_s: float = Field(5.0, gt=0)  # the outbox written, stream entries acknowledged
    # The compact summary (services/persist/decide.py): when each node was last seen, identities changed.
    summary_interval_s: float = Field(30.0, gt=0)
    retry_backoff_s: float = Field(0.2, gt=0)
    retry_backoff_max_s: float = Field(5.0, gt=0)
    # The event stream GET /v1/stream (services/api/routes/stream.py): how often it polls the events
    # table for new rows, and how long a quiet stream waits before a ": keepalive" comment.
    stream_poll_s: float = Field(0.5, gt=0)
    stream_keepalive_s: float = Field(15.0, gt=0)
    # How often an open stream checks its token in the database (a revoke on another replica
    # ends it within this; one on the stream's own replica at once).
    stream_token_check_s: float = Field(1.0, gt=0)
    # SIGTERM (services/api/server.py): every event stream ends at once (its client reconnects with
    # Last-Event-ID, to another replica if this one is gone); a request still running this long
    # after is cancelled, then the loops stop and the last outbox is written.
    shutdown_grace_s: float = Field(5.0, gt=0)
    # The status page GET / (services/api/routes/status_page.py): how often it re-reads the API.
    status_refresh_s: float = Field(3.0, ge=0.2)
    # ... and how many nodes it reads a request (GET /v1/nodes?fields=summary&limit=).
    status_page_nodes: int = Field(5000, ge=1, le=10_000)  # 16,384 nodes: 4 requests (docs/benchmarks.md)

    # Retention (services/retention.py): events, finished jobs, superseded plans and stored GPU rows
    # older than this many days are deleted by the leader, a batch per transaction; 0 keeps all.
    retention_days: float = Field(30.0, ge=0)
    retention_interval_s: float = Field(3600.0, gt=0)  # how often the leader prunes
    retention_batch: int = Field(1000, ge=1)  # rows per transaction

    # Slurm node sync (services/slurm/nodes/decide.py, services/slurm/nodes/loop.py): the leader
    # drains in Slurm the nodes that are DEGRADED, LOST or cordoned here, and resumes the drains it
    # made once they are HEALTHY again. Off unless PULSE_SLURM=on.
    slurm: bool = False
    slurm_max_drain_fraction: float = Field(0.1, gt=0, le=1)  # drains within the window, of the nodes
    slurm_drain_window_s: float = Field(3600.0, gt=0)
    # a node worse only through its GPUs' own faults is drained from this many bad GPUs on
    slurm_drain_min_bad_gpus: int = Field(2, ge=1)
    # a GPU DEGRADED or LOST by a fault of its own this long is reported for a reset (once)
    gpu_reset_after_s: float = Field(3600.0, gt=0)
    # what an agent runs to reset GPU {index} (POST /v1/nodes/{name}/gpus/{index}/reset)
    gpu_reset_command: str = "nvidia-smi --gpu-reset -i {index}"
    slurm_sync_period_s: float = Field(10.0, gt=0)  # also the first retry delay when Slurm fails
    slurm_backoff_max_s: float = Field(120.0, gt=0)  # the longest retry delay while Slurm fails
    slurm_command_timeout_s: float = Field(10.0, gt=0)  # each sinfo / scontrol call
    slurm_conf: str = ""  # SLURM_CONF for the commands; empty: Slurm's own default
    slurm_sinfo: str = "sinfo"  # the commands (a path, or a command line such as "sudo -n sinfo")
    slurm_scontrol: str = "scontrol"
    # The Slurm job backend (services/slurm/jobs/decide.py, services/slurm/jobs/loop.py), with
    # PULSE_SLURM=on: a job created with "backend": "slurm" (or any job, with
    # PULSE_JOB_BACKEND=slurm) is submitted with sbatch and its state follows Slurm's. The agents'
    # launcher stays the default.
    job_backend: Literal["agents", "slurm"] = "agents"
    slurm_sbatch: str = "sbatch"
    slurm_scancel: str = "scancel"
    slurm_sacct: str = "sacct"  # a job scontrol no longer lists is looked up here (empty: never)
    slurm_job_poll_s: float = Field(2.0, gt=0)  # how often the leader reads its jobs' Slurm state
    slurm_exit_wait_s: float = Field(10.0, ge=0)  # a Slurm job that ended waits this long for its ranks' exits
    slurm_gres: str = Field("gpu", pattern=r"^[A-Za-z0-9_/]*$")  # --gres=<this>:<gpus_per_node>; "": none
    slurm_partition: str = ""  # --partition; "": Slurm's default partition
    slurm_workdir: str = ""  # --chdir of the batch script and ranks; "": the orchestrator's own
    slurm_output_dir: str = ""  # folder of each job's batch output (pulse-<job>-<slurm id>.out); "": Slurm's default
    slurm_python: str = ""  # the Python the ranks run on the Slurm nodes; "": the orchestrator's own

    # High availability (services/leader.py): replicas on one database and Redis, one leader
    replica_id: str = Field("", max_length=128)  # this replica's name; default <hostname>-<pid>
    leader_lease_s: float = Field(15.0, gt=0)  # failover within one lease
    leader_renew_s: float | None = Field(None, gt=0)  # default lease / 3
    leader_margin_s: float | None = Field(None, ge=0)  # stop leading this early; default lease / 10
    # Tests only (tests/faults): the orchestrator SIGKILLs itself at this named point, ``NAME`` or
    # ``NAME:N`` (the N-th time there): ``transition`` (applied in memory, not yet published or
    # stored), ``plan`` (a plan generation published to Redis, not yet stored). Empty: never.
    crash_at: str = ""

    @property
    def suspect_after(self) -> float:
        return self.suspect_after_s if self.suspect_after_s is not None else 2 * self.heartbeat_interval_s

    @property
    def reads_need_token(self) -> bool:
        return self.auth_reads if self.auth_reads is not None else self.env == "production"

    @property
    def heartbeat_ttl(self) -> float:
        return self.heartbeat_ttl_s if self.heartbeat_ttl_s is not None else 3 * self.degraded_after_s

    @property
    def leader_renew(self) -> float:
        return self.leader_renew_s if self.leader_renew_s is not None else self.leader_lease_s / 3

    @property
    def leader_margin(self) -> float:
        return self.leader_margin_s if self.leader_margin_s is not None else self.leader_lease_s / 10

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.leader_renew >= self.leader_lease_s - self.leader_margin:
            raise ValueError(
                f"leader_renew_s ({self.leader_renew}s) must be below leader_lease_s - leader_margin_s "
                f"({self.leader_lease_s}s - {self.leader_margin}s): a leader renews before it stops trusting its lease"
            )
        if self.suspect_after >= self.degraded_after_s:
            raise ValueError(
                f"suspect_after ({self.suspect_after}s) must be below degraded_after_s ({self.degraded_after_s}s)"
            )
        if self.lost_after_s < self.degraded_after_s:
            raise ValueError(
                f"lost_after_s ({self.lost_after_s}s) must not be below degraded_after_s ({self.degraded_after_s}s)"
            )
        if self.job_port_base + self.job_port_span - 1 > 65535:
            raise ValueError(
                f"PULSE_JOB_PORT_BASE={self.job_port_base} with PULSE_JOB_PORT_SPAN={self.job_port_span} "
                f"reaches port {self.job_port_base + self.job_port_span - 1}; the last port is 65535"
            )
        if self.job_commands_max_age_s < self.job_command_ttl_s:
            raise ValueError(
                f"PULSE_JOB_COMMANDS_MAX_AGE_S={self.job_commands_max_age_s:g} is below "
                f"PULSE_JOB_COMMAND_TTL_S={self.job_command_ttl_s:g}: a command stream must keep its current commands"
            )
        if self.redis_cluster and urlsplit(self.redis_url).path not in ("", "/", "/0"):
            raise ValueError(
                f"PULSE_REDIS_URL={self.redis_url!r} names a database other than 0: a Redis Cluster has only "
                "database 0 (PULSE_REDIS_CLUSTER=true)"
            )
        if self.job_backend == "slurm" and not self.slurm:
            raise ValueError("PULSE_JOB_BACKEND=slurm needs PULSE_SLURM=on (the Slurm commands and SLURM_CONF)")
        if self.env == "production" and self.crash_at:
            raise ValueError(f"PULSE_CRASH_AT={self.crash_at!r} is for tests only; unset it when PULSE_ENV=production")
        if self.env == "production" and len(self.api_token) < 16:
            raise ValueError("PULSE_API_TOKEN must be set (16+ characters) when PULSE_ENV=production")
        return self


def load_settings(**overrides: object) -> Settings:
    """The process's settings: environment first, then ``overrides`` (tests, CLI flags)."""
    return Settings(**overrides)  # type: ignore[arg-type]
