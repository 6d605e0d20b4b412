"""What a training rank calls after each optimizer step: progress reports that never stall training.

Usage in a DeepSpeed loop (``trainer/example.py`` is the complete version)::

    reporter = TrainerReporter(job="llm-7b", flops_per_token=fpt, peak_flops_per_device=peak,
                               tokens_per_step=micro_batch * grad_accum * seq_len)
    timer = StepTimer()
    for step in range(1, steps + 1):
        loss = engine(batch); engine.backward(loss); engine.step()
        reporter.report(step=step, loss=loss.item(), grad_norm=engine.get_global_grad_norm(),
                        step_time_s=timer.lap())
    reporter.close()

The contract of :class:`TrainerReporter`: ``report()`` only appends to a bounded in-memory queue
(microseconds; no I/O, never blocks or raises on Redis's account); a daemon thread sends what is
queued every ``flush_interval_s``, at least once, backing off while Redis is down and dropping the
oldest report when the queue is full. Its first send registers the rank. The costs and the rest:
``docs/design/report.md``.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from clusterpulse import wire
from clusterpulse.redis_client import CLUSTER_ENV, CLUSTER_TRANSIENT, LazyClient, env_flag
from clusterpulse.retry import Backoff, is_transient
from trainer import mfu as mfu_lib
from trainer.rank_gpu import rank_gpu

log = logging.getLogger("pulse.trainer.report")


class StepTimer:
    """Wall time between consecutive step boundaries (``time.perf_counter``).

    Created (or :meth:`reset`) just before the first step; :meth:`lap` at each boundary returns the
    seconds since the previous boundary.
    """

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def reset(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


class LossSpikeDetector:
    """Flags a loss over ``factor`` x the mean of the losses of the last ``window`` steps, and any
    non-finite loss or gradient norm.

    :meth:`update` returns ``None`` for a normal loss, else a reason whose first word is the kind
    (``nonfinite_loss``, ``nonfinite_grad_norm``, ``loss_spike``). A spike is judged only once the
    window holds ``min(window, MIN_HISTORY)`` losses (the first steps' losses fall fast), against
    a positive mean. The mean, not the window's lowest loss: a noisy but healthy loss near its floor
    (a small batch's MSE) is often ten times its lowest, almost never ten times its mean.
    Non-finite losses are not remembered; a spike is. Steps are expected not to decrease (several
    losses of one step, its micro-steps, are fine); a step below the last one seen (a resume from a
    checkpoint) starts the window afresh.
    """

    MIN_HISTORY = 10

    def __init__(self, window: int = 100, factor: float = 10.0) -> None:
        if window < 1:
            raise ValueError(f"window={window}: expected >= 1 step")
        if not factor > 1:
            raise ValueError(f"factor={factor}: expected > 1")
        self.window = window
        self.factor = factor
        self._seen: collections.deque[tuple[int, float]] = collections.deque()  # (step, loss), in order

    def update(self, step: int, loss: float | None, grad_norm: float | None = None) -> str | None:
        if loss is not None and not math.isfinite(loss):
            return f"nonfinite_loss loss={loss} at step {step}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"nonfinite_grad_norm grad_norm={grad_norm} at step {step}"
        if loss is None:
            return None
        seen = self._seen
        if seen and step < seen[-1][0]:
            seen.clear()
        while seen and seen[0][0] < step - self.window:  # the window: the steps before, and this one's
            seen.popleft()
        reason = None
        if len(seen) >= min(self.window, self.MIN_HISTORY):
            mean = sum(x for _, x in seen) / len(seen)
            if mean > 0 and loss > self.factor * mean:
                reason = (
                    f"loss_spike loss={loss:.6g} at step {step} > {self.factor:g} x mean {mean:.6g} "
                    f"of the last {len(seen)} losses"
                )
        seen.append((step, loss))
        return reason


def cosine_warmup(step: int, *, warmup: int, total: int, base_lr: float, min_lr: float = 0.0) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warmup, then cosine decay.

    ``step < warmup``: ``base_lr * step / warmup`` (0 at step 0, as in Hugging Face's
    ``get_cosine_schedule_with_warmup``). Then ``min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2``
    with ``p = (step - warmup) / (total - warmup)``, reaching ``min_lr`` at ``total`` and staying
    there after it.
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: expected >= 0 steps")
    if total < warmup:
        raise ValueError(f"total={total}: expected >= warmup ({warmup})")
    if step < 0:
        raise ValueError(f"step={step}: expected >= 0")
    if step < warmup:
        return base_lr * step / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def env_peak_flops() -> float | None:
    """``PULSE_PEAK_FLOPS`` (peak FLOP/s per device, a float), or ``None`` when unset."""
    raw = os.environ.get("PULSE_PEAK_FLOPS")
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"PULSE_PEAK_FLOPS={raw!r}: expected FLOP/s as a float, e.g. 1e11") from None
    if not value > 0:
        raise ValueError(f"PULSE_PEAK_FLOPS={raw!r}: expected > 0")
    return value


def _default_node() -> str:
    host = socket.gethostname()
    return host if wire.valid_node_name(host) else host.split(".")[0]


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def xadd_prefix(stream: str, field: bytes, maxlen: int) -> bytes:
    """Redis protocol of ``XADD stream MAXLEN ~ maxlen * field`` up to the value: one command per
    payload is ``prefix + b"$<len>\r\n" + payload + b"\r\n"`` (see :func:`pack_xadds`)."""
    args = (b"XADD", stream.encode(), b"MAXLEN", b"~", b"%d" % maxlen, b"*", field)
    return b"*8\r\n" + b"".join(_bulk(a) for a in args)


def pack_xadds(prefix: bytes, payloads: Iterable[bytes]) -> list[bytes]:
    """The parts of one ``XADD`` per payload (``prefix`` from :func:`xadd_prefix`), to be joined.

    What redis-py's pipeline would send for the same commands, without its per-command argument
    handling: a few hundred nanoseconds a report instead of several microseconds.
    """
    parts: list[bytes] = []
    add = parts.append
    for payload in payloads:
        add(prefix)
        add(b"$%d\r\n" % len(payload))
        add(payload)
        add(b"\r\n")
    return parts


def _registration(
    *, job: str | None, rank: int | None, node: str | None, world_size: int | None, local_rank: int | None
) -> wire.RankRegistration:
    """Who this reporter speaks for: what is given, else what the launcher set (see
    :class:`TrainerReporter`), checked; a ValueError names what is wrong."""
    job = job if job is not None else os.environ.get("PULSE_JOB_ID")
    if not job:
        raise ValueError("job: no job id given and PULSE_JOB_ID is not set")
    node = node if node is not None else (os.environ.get("PULSE_NODE") or _default_node())
    if not wire.valid_node_name(node):
        raise ValueError(f"node={node!r}: expected a name matching {wire.NODE_NAME_PATTERN}")
    rank = rank if rank is not None else _env_int("RANK", 0)
    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", 0)
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
    if rank < 0 or world_size < 1 or rank >= world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    if local_rank < 0:
        raise ValueError(f"local_rank={local_rank}: expected >= 0")
    gpu = rank_gpu(os.environ, local_rank)  # trainer/rank_gpu.py: PULSE_GPU, else CUDA_VISIBLE_DEVICES
    return wire.RankRegistration(
        v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=node, local_rank=local_rank, world_size=world_size, gpu=gpu
    )


def _check_sizes(**sizes: int) -> None:
    """Counts and lengths: each at least 1, else a ValueError naming it."""
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value}: expected >= 1")


def _check_positive(**values: float | None) -> None:
    """FLOP/s and durations: each above 0 (``None``: not given), else a ValueError naming it."""
    for name, value in values.items():
        if value is not None and not value > 0:
            unit = "FLOP/s" if "flops" in name else "seconds"
            raise ValueError(f"{name}={value}: expected > 0 {unit}")


class TrainerReporter:
    """Publishes one :class:`clusterpulse.wire.TrainerReport` per (due) step from a background thread.

    Identity falls back to the environment a launcher sets: ``job`` to ``PULSE_JOB_ID``, ``rank``
    to ``RANK`` (else 0), ``node`` to ``PULSE_NODE`` (else the host name), ``world_size`` to
    ``WORLD_SIZE`` (else 1); ``redis_url`` to ``PULSE_REDIS_URL``, ``redis_cluster`` to
    ``PULSE_REDIS_CLUSTER`` (a Redis Cluster: the reports go to the master of their stream's
    slot, followed across a failover or a resharding); ``peak_flops_per_device`` to
    ``PULSE_PEAK_FLOPS``. MFU is reported when ``flops_per_token``, ``tokens_per_step``, a step time
    and a peak are all known, else ``None``. See the module docstring for the delivery contract.

    Durations: ``flush_interval_s`` between the thread's sends (the latency of a report on the
    wire; the thread's cost per step falls as it grows), ``timeout_s`` for connecting to Redis and
    for each socket read and write, ``backoff`` between tries while Redis is down; :meth:`flush`
    and :meth:`close` take their own timeouts. ``queue_size`` bounds the reports held while Redis
    is away; ``batch_size`` bounds one round trip.
    """

    def __init__(
        self,
        *,
        job: str | None = None,
        rank: int | None = None,
        node: str | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        redis_url: str | None = None,
        redis_cluster: bool | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        tokens_per_step: int | None = None,
        every: int = 1,
        maxlen: int = 100_000,
        queue_size: int = 1024,
        batch_size: int = 512,
        timeout_s: float = 2.0,
        flush_interval_s: float = 0.5,
        backoff: Backoff | None = None,
        spike_detector: LossSpikeDetector | None = None,
    ) -> None:
        self.registration = _registration(job=job, rank=rank, node=node, world_size=world_size, local_rank=local_rank)
        _check_sizes(every=every, maxlen=maxlen, queue_size=queue_size, batch_size=batch_size)
        _check_positive(
            peak_flops_per_device=peak_flops_per_device, flush_interval_s=flush_interval_s, timeout_s=timeout_s
        )
        if redis_url is None:
            redis_url = os.environ.get("PULSE_REDIS_URL") or "redis://127.0.0.1:6379/0"
        if redis_cluster is None:
            redis_cluster = env_flag(os.environ.get(CLUSTER_ENV))
        reg = self.registration
        self.job, self.rank, self.node, self.world_size = reg.job, reg.rank, reg.node, reg.world_size
        self.local_rank = reg.local_rank
        self.flops_per_token: float | None = None
        self.peak_flops_per_device = peak_flops_per_device if peak_flops_per_device is not None else env_peak_flops()
        self.tokens_per_step: int | None = None
        self._mfu_per_token_s: float | None = None
        self.declare(tokens_per_step=tokens_per_step, flops_per_token=flops_per_token)
        self.every = every
        self.maxlen = maxlen
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.detector = spike_detector if spike_detector is not None else LossSpikeDetector()

        self.last_step = 0  # the highest step reported, which the exit report repeats
        self.published = 0
        self.dropped = 0  # oldest reports dropped because the queue was full
        self.rejected = 0  # reports Redis refused with a permanent error
        self.failures = 0  # failed round trips (Redis down or slow)
        self.events = 0  # training-safety events seen
        self.thread_cpu_s = 0.0  # CPU seconds the publishing thread has used, updated after each send

        self._cluster, self._stale = redis_cluster, False  # stale: a Cluster's slot map to read again
        retry = Retry(NoBackoff(), 0)  # our own backoff, on our own thread; a Cluster's client is made there
        self._redis = LazyClient(redis_url, cluster=redis_cluster, timeout_s=timeout_s, retry=retry)
        self._report_prefix = xadd_prefix(wire.TRAINER_STREAM, wire.TRAINER_FIELD, maxlen)
        self._registration_command = b"".join(
            pack_xadds(
                xadd_prefix(wire.REGISTRATION_STREAM, wire.REGISTRATION_FIELD, maxlen),
                [wire.encode(self.registration)],
            )
        )
        self._conn: redis.connection.ConnectionInterface | None = None  # the thread's own, kept
        self._backoff = backoff if backoff is not None else Backoff()
        # Shared with the publishing thread under _lock, a plain lock that report() holds for an
        # append and the thread for a swap: never contended long, never a thread wake-up.
        self._lock = threading.Lock()
        self._queue: collections.deque[wire.TrainerReport] = collections.deque()
        self._queue_size = queue_size
        self._inflight = 0
        self._register_pending = True  # sent by the thread first, retried like a report
        self._closing = False
        self._wake = threading.Event()  # the interval cut short: a safety event, flush(), close()
        self._sent = threading.Condition()  # notified after each send attempt, for flush()
        self._thread = threading.Thread(target=self._run, name=f"pulse-reporter-{self.rank}", daemon=True)
        self._thread.start()

    # --- the training thread ---------------------------------------------------------------

    def declare(self, *, tokens_per_step: int | None, flops_per_token: float | None) -> None:
        """Set what MFU needs once it is known (a library that counts tokens learns them at the
        first step). ``None`` leaves tokens/s or MFU absent: never invented."""
        if tokens_per_step is not None and tokens_per_step < 0:
            raise ValueError(f"tokens_per_step={tokens_per_step}: expected >= 0")
        if flops_per_token is not None and not flops_per_token >= 0:
            raise ValueError(f"flops_per_token={flops_per_token}: expected >= 0")
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        # MFU is linear in tokens/s: the ratio of one token a second, worked out once.
        self._mfu_per_token_s = (
            mfu_lib.mfu(
                tokens_per_s=1.0,
                flops_per_token=flops_per_token,
                ranks=1,
                peak_flops_per_device=self.peak_flops_per_device,
            )
            if flops_per_token is not None and self.peak_flops_per_device is not None
            else None
        )

    def report(
        self,
        *,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        loss_scale: float | None = None,
        step_time_s: float | None = None,
        plan_generation: int | None = None,
        unreachable_ranks: list[int] | None = None,
        note: str | None = None,
        phases: wire.StepPhases | None = None,
        update_ratio: float | None = None,
    ) -> wire.TrainerReport | None:
        """Queue this step's report (when due, when a safety event fires, or when
        ``unreachable_ranks`` names degraded ranks this rank as their carrier gave up on: those
        go out at once, whatever the cadence); returns it, or ``None`` when not due. Never blocks
        on Redis, never raises on its account. Non-finite floats travel as JSON ``null`` and the
        ``event`` says which one was not finite. ``phases``: where the step's time went
        (:class:`trainer.phases.PhaseClock`); ``update_ratio``: measured at this step (always sent).
        ``note``: events of the protocol's own (``checkpoint_written <dir>``, one a line), always
        sent, before this step's anomaly on the next line."""
        self.last_step = max(self.last_step, step)
        anomaly = self.detector.update(step, loss, grad_norm)
        if anomaly is not None:
            self.events += 1
            log.warning("event=training_anomaly job=%s rank=%d step=%d reason=%r", self.job, self.rank, step, anomaly)
        event = "\n".join(e for e in (note, anomaly) if e is not None) or None
        if event is None and step % self.every != 0 and not unreachable_ranks and update_ratio is None:
            return None
        tokens_per_s = None
        mfu_ratio = None
        if step_time_s is not None and step_time_s > 0 and self.tokens_per_step is not None:
            tokens_per_s = self.tokens_per_step / step_time_s
            if self._mfu_per_token_s is not None:
                mfu_ratio = tokens_per_s * self._mfu_per_token_s
        rep = wire.TrainerReport(
            v=wire.PROTOCOL_VERSION,
            job=self.job,
            rank=self.rank,
            node=self.node,
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            loss_scale=loss_scale,
            step_time_s=step_time_s if step_time_s is not None and step_time_s >= 0 else None,
            tokens_per_s=tokens_per_s,
            mfu_ratio=mfu_ratio,
            plan_generation=plan_generation,
            unreachable_ranks=unreachable_ranks or None,
            event=event[:512] if event is not None else None,
            phases=phases,
            update_ratio=update_ratio if update_ratio is not None and math.isfinite(update_ratio) else None,
        )
        with self._lock:
            queue = self._queue
            if len(queue) >= self._queue_size:
                queue.popleft()
                self.dropped += 1
            queue.append(rep)
        if event is not None or unreachable_ranks:
            self._wake.set()
        return rep

    def report_exit(self, code: int) -> None:
        """Queue this rank's last report: its process leaves with ``code`` (sent at once)."""
        rep = wire.TrainerReport(
            v=wire.PROTOCOL_VERSION, job=self.job, rank=self.rank, node=self.node, step=self.last_step, exit_code=code
        )
        with self._lock:
            self._queue.append(rep)
        self._wake.set()

    @property
    def pending(self) -> int:
        """Reports queued or in flight, not yet acknowledged by Redis (the registration counts one)."""
        with self._lock:
            return len(self._queue) + self._inflight + int(self._register_pending)

    def flush(self, timeout: float = 5.0) -> bool:
        """Send what is queued now rather than at the next interval and wait at most ``timeout``
        seconds for Redis to acknowledge it; True when nothing is pending. While the thread backs
        off from a Redis that is down it keeps its backoff, so this waits out the timeout."""
        self._wake.set()
        with self._sent:
            self._sent.wait_for(lambda: self.pending == 0 or not self._thread.is_alive(), timeout)
        return self.pending == 0

    def close(self, timeout: float = 5.0) -> bool:
        """Flush what is queued (one last try even while backing off) and stop the thread, waiting
        at most ``timeout`` seconds. True when everything queued reached Redis."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        left = self.pending
        if left or self._thread.is_alive():
            log.warning(
                "event=reporter_closed_with_pending job=%s rank=%d pending=%d dropped=%d",
                self.job,
                self.rank,
                left,
                self.dropped,
            )
        self._redis.close()  # disconnects the thread's connection too
        return left == 0

    def __enter__(self) -> TrainerReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- the publishing thread -------------------------------------------------------------

    def _run(self) -> None:
        retry_at = 0.0
        wait_s = 0.0  # register at once
        while True:
            self._wake.wait(wait_s)
            self._wake.clear()  # _closing is read after: a close() that set it is never missed
            closing = self._closing
            now = time.monotonic()
            if not closing and now < retry_at:
                wait_s = retry_at - now  # woken while backing off: the backoff stands
                continue
            if self._drain():
                retry_at = 0.0
                wait_s = self.flush_interval_s
            else:
                delay = self._backoff.next_delay()
                retry_at = time.monotonic() + delay
                wait_s = delay
            with self._sent:
                self._sent.notify_all()
            self.thread_cpu_s = time.thread_time()  # this thread's, since it started
            if closing:
                return

    def _drain(self) -> bool:
        """Send everything queued, ``batch_size`` reports a round trip. False after a transient
        failure (that batch is back at the head of the queue), True otherwise."""
        while True:
            with self._lock:
                register = self._register_pending
                queue = self._queue
                if not queue and not register:
                    return True
                batch: collections.deque[wire.TrainerReport] | list[wire.TrainerReport]
                if len(queue) <= self.batch_size:
                    batch, self._queue = queue, collections.deque()
                else:
                    batch = [queue.popleft() for _ in range(self.batch_size)]
                self._inflight = len(batch)
            try:
                replies = self._send(register, batch)
            except Exception as exc:
                if is_transient(exc):
                    self.failures += 1
                    if self._backoff.failures == 0:  # the first failure of this outage
                        log.warning(
                            "event=redis_unavailable job=%s rank=%d error=%r failures=%d",
                            self.job,
                            self.rank,
                            exc,
                            self.failures,
                        )
                    self._give_back(batch)
                    return False
                # Permanent, before any reply (a Redis refusing the connection's setup): this batch
                # is lost, the next one is tried.
                replies = [exc] * (int(register) + len(batch))
            if self._backoff.failures:
                log.info("event=redis_reconnected job=%s rank=%d failures=%d", self.job, self.rank, self.failures)
                self._backoff.reset()
            errors = [e for e in replies if e is not None]
            if errors:  # permanent: these reports are dropped, a retry would fail alike
                log.error(
                    "event=reports_rejected job=%s rank=%d count=%d error=%r",
                    self.job,
                    self.rank,
                    len(errors),
                    errors[0],
                )
            with self._lock:
                self._inflight = 0
                self._register_pending = False
                rejected = sum(1 for e in replies[int(register) :] if e is not None)
                self.rejected += rejected
                self.published += len(batch) - rejected

    def _send(self, register: bool, batch: Sequence[wire.TrainerReport]) -> list[Exception | None]:
        """One round trip: the registration when due, then one ``XADD`` per report, written at once.

        Returns each command's error reply or ``None``, in order; raises on a connection error or
        a timeout (the connection is then dropped, so a retry starts clean)."""
        encode = wire.encode
        parts = pack_xadds(self._report_prefix, [encode(rep) for rep in batch])
        if register:
            parts.insert(0, self._registration_command)
        commands = int(register) + len(batch)
        conn = self._conn
        if conn is None:  # connects, or raises; a connection dropped after an error reconnects on send
            conn = self._conn = self._connection()
        try:
            conn.send_packed_command([b"".join(parts)], check_health=False)  # type: ignore[no-untyped-call]
            replies: list[Exception | None] = []
            for _ in range(commands):
                try:
                    conn.read_response()
                except redis.exceptions.ResponseError as exc:
                    replies.append(exc)
                else:
                    replies.append(None)
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]
            if self._cluster:  # the master may have failed over: the slot map is read again
                self._conn, self._stale = None, True
            raise
        if self._cluster and any(isinstance(e, CLUSTER_TRANSIENT) for e in replies):
            # the stream's slot moved (MOVED), is moving (ASK) or has no master yet: the whole
            # batch again, at the slot's master as the refreshed map says (at least once: a
            # report that got in before is sent twice, which the orchestrator folds once)
            conn.disconnect()  # type: ignore[no-untyped-call]
            self._conn, self._stale = None, True
            raise next(e for e in replies if isinstance(e, CLUSTER_TRANSIENT))
        return replies

    def _connection(self) -> redis.connection.ConnectionInterface:
        """The thread's connection: to the one Redis, or to the master of the report stream's slot."""
        client = self._redis.get()
        if not isinstance(client, redis.RedisCluster):
            return client.connection_pool.get_connection()
        if self._stale:
            client.nodes_manager.initialize()
            self._stale = False
        node = client.get_node_from_key(wire.TRAINER_STREAM)  # type: ignore[no-untyped-call]
        return client.get_redis_connection(node).connection_pool.get_connection()

    def _give_back(self, batch: Iterable[wire.TrainerReport]) -> None:
        """Put a failed batch back at the head, oldest dropped beyond the bound."""
        batch = list(batch)
        with self._lock:
            self._inflight = 0
            room = self._queue_size - len(self._queue)
            keep = batch[-room:] if room > 0 else []
            self.dropped += len(batch) - len(keep)
            self._queue.extendleft(reversed(keep))
