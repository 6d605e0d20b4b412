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

Contract of :class:`TrainerReporter`:

- ``report()`` only computes a few floats and appends to a bounded in-memory queue; it never does
  I/O, never blocks on Redis and never raises because of Redis. A daemon thread drains the queue
  into ``XADD`` of :data:`clusterpulse.wire.TRAINER_STREAM` (field
  :data:`clusterpulse.wire.TRAINER_FIELD`, trimmed approximately to ``maxlen``), one pipelined
  round trip per batch and at most one per ``linger_s`` (0.05 s), with a socket timeout and no
  hidden retries in the client. The thread first registers the rank (a
  :class:`clusterpulse.wire.RankRegistration` on :data:`clusterpulse.wire.REGISTRATION_STREAM`).
- Redis down: the batch goes back to the head of the queue and the thread backs off
  (:class:`clusterpulse.retry.Backoff`, capped exponential with jitter); when the queue is full
  the *oldest* report is dropped and counted in :attr:`TrainerReporter.dropped` (the newest
  reports are the ones worth having once Redis answers again). A permanent error (a Redis that
  answers with an error) drops that batch, counted in ``rejected``, and logs it.
- Per rank, not per job: ``tokens_per_s`` is this rank's tokens (``tokens_per_step`` is the
  rank's own share of a step: micro batch x accumulation x sequence length under data
  parallelism, the global tokens / world size under model parallelism) over its step time, and
  ``mfu_ratio`` is this rank's MFU. The orchestrator sums tokens/s and averages MFU over ranks
  (``services/progress.py``).
- Step time is the wall time between consecutive step boundaries (:class:`StepTimer`): data,
  forward, backward, all-reduce and optimizer together. Timing only ``engine.step()`` would leave
  out forward and backward and overstate throughput several times. On a GPU the figure is right
  in the steady state as soon as the loop synchronises once per step (``loss.item()`` does).
- ``every=N`` publishes steps divisible by N; a training-safety event (:class:`LossSpikeDetector`,
  fed at every call) is published at once whatever the cadence, in the report's ``event``.

Also here, small and pure: :class:`LossSpikeDetector` and :func:`cosine_warmup`.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from clusterpulse import wire
from clusterpulse.retry import Backoff, is_transient
from trainer import mfu as mfu_lib

log = logging.getLogger("pulse.trainer.report")

_BATCH = 256  # reports per pipelined round trip


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
    """Flags a step whose loss is over ``factor`` x the lowest loss of the last ``window`` steps,
    and any non-finite loss or gradient norm.

    :meth:`update` returns ``None`` for a normal step, else a reason whose first word is the kind
    (``nonfinite_loss``, ``nonfinite_grad_norm``, ``loss_spike``). Non-finite losses are not
    remembered; a spike is (a second spike in a row is still measured against the window's
    minimum). The ratio test needs a positive minimum: with a minimum <= 0 it never fires.
    """

    def __init__(self, window: int = 100, factor: float = 10.0) -> None:
        if window < 1:
            raise ValueError(f"window={window}: expected >= 1 step")
        if not factor > 1:
            raise ValueError(f"factor={factor}: expected > 1")
        self.window = window
        self.factor = factor
        self._seen: collections.deque[tuple[int, float]] = collections.deque()

    def update(self, step: int, loss: float | None, grad_norm: float | None = None) -> str | None:
        if loss is not None and not math.isfinite(loss):
            return f"nonfinite_loss loss={loss} at step {step}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"nonfinite_grad_norm grad_norm={grad_norm} at step {step}"
        if loss is None:
            return None
        while self._seen and self._seen[0][0] <= step - self.window:
            self._seen.popleft()
        reason = None
        if self._seen:
            low = min(v for _, v in self._seen)
            if low > 0 and loss > self.factor * low:
                reason = (
                    f"loss_spike loss={loss:.6g} at step {step} > {self.factor:g} x min {low:.6g} "
                    f"of the last {self.window} steps"
                )
        self._seen.append((step, loss))
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


class TrainerReporter:
    """Publishes one :class:`clusterpulse.wire.TrainerReport` per (due) step from a background thread.

    Identity falls back to the environment a launcher sets: ``job`` to ``PULSE_JOB_ID``, ``rank``
    to ``RANK`` (else 0), ``node`` to ``PULSE_NODE`` (else the host name), ``world_size`` to
    ``WORLD_SIZE`` (else 1); ``redis_url`` to ``PULSE_REDIS_URL``; ``peak_flops_per_device`` to
    ``PULSE_PEAK_FLOPS``. MFU is reported when ``flops_per_token``, ``tokens_per_step``, a step time
    and a peak are all known, else ``None``. See the module docstring for the delivery contract.
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
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        tokens_per_step: int | None = None,
        every: int = 1,
        maxlen: int = 100_000,
        queue_size: int = 1024,
        timeout_s: float = 2.0,
        linger_s: float = 0.05,
        backoff: Backoff | None = None,
        spike_detector: LossSpikeDetector | None = None,
    ) -> None:
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
        for name, value in (("every", every), ("maxlen", maxlen), ("queue_size", queue_size)):
            if value < 1:
                raise ValueError(f"{name}={value}: expected >= 1")
        if tokens_per_step is not None and tokens_per_step < 0:
            raise ValueError(f"tokens_per_step={tokens_per_step}: expected >= 0")
        if redis_url is None:
            redis_url = os.environ.get("PULSE_REDIS_URL") or "redis://127.0.0.1:6379/0"
        self.job, self.rank, self.node, self.world_size = job, rank, node, world_size
        self.local_rank = local_rank
        self.registration = wire.RankRegistration(
            v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=node, local_rank=local_rank, world_size=world_size
        )
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device if peak_flops_per_device is not None else env_peak_flops()
        self.tokens_per_step = tokens_per_step
        self.every = every
        self.maxlen = maxlen
        self.linger_s = linger_s
        self.detector = spike_detector if spike_detector is not None else LossSpikeDetector()

        self.published = 0
        self.dropped = 0  # oldest reports dropped because the queue was full
        self.rejected = 0  # reports Redis refused with a permanent error
        self.failures = 0  # failed round trips (Redis down or slow)
        self.events = 0  # training-safety events seen

        self._redis = redis.Redis.from_url(
            redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # our own backoff, on our own thread
        )
        self._backoff = backoff if backoff is not None else Backoff()
        self._queue: collections.deque[wire.TrainerReport] = collections.deque()
        self._queue_size = queue_size
        self._inflight = 0
        self._register_pending = True  # sent by the thread first, retried like a report
        self._cond = threading.Condition()
        self._closing = False
        self._closed = threading.Event()  # cuts the linger short on close()
        self._thread = threading.Thread(target=self._run, name=f"pulse-reporter-{rank}", daemon=True)
        self._thread.start()

    # --- the training thread ---------------------------------------------------------------

    def report(
        self,
        *,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        loss_scale: float | None = None,
        step_time_s: float | None = None,
        plan_generation: int | None = None,
    ) -> wire.TrainerReport | None:
        """Queue this step's report (when due, or when a safety event fires); returns it, or
        ``None`` when not due. Never blocks on Redis, never raises on its account. Non-finite
        floats travel as JSON ``null`` and the ``event`` says which one was not finite."""
        event = self.detector.update(step, loss, grad_norm)
        if event is not None:
            self.events += 1
            log.warning("event=training_anomaly job=%s rank=%d step=%d reason=%r", self.job, self.rank, step, event)
        if event is None and step % self.every != 0:
            return None
        tokens_per_s = None
        mfu_ratio = None
        if step_time_s is not None and step_time_s > 0 and self.tokens_per_step is not None:
            tokens_per_s = self.tokens_per_step / step_time_s
            if self.flops_per_token is not None and self.peak_flops_per_device is not None:
                mfu_ratio = mfu_lib.mfu(
                    tokens_per_s=tokens_per_s,
                    flops_per_token=self.flops_per_token,
                    ranks=1,
                    peak_flops_per_device=self.peak_flops_per_device,
                )
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
            event=event[:512] if event is not None else None,
        )
        with self._cond:
            if len(self._queue) >= self._queue_size:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(rep)
            self._cond.notify()
        return rep

    @property
    def pending(self) -> int:
        """Reports queued or in flight, not yet acknowledged by Redis (the registration counts one)."""
        with self._cond:
            return len(self._queue) + self._inflight + int(self._register_pending)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush what is queued (one last try even while backing off) and stop the thread, waiting
        at most ``timeout`` seconds. True when everything queued reached Redis."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._closed.set()
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
        self._redis.close()
        return left == 0

    def __enter__(self) -> TrainerReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- the publishing thread -------------------------------------------------------------

    def _take(self, retry_at: float) -> list[wire.TrainerReport] | None:
        """Wait for something to send (and for the backoff to pass); None when closing is done."""
        with self._cond:
            while True:
                now = time.monotonic()
                work = bool(self._queue) or self._register_pending
                if self._closing:
                    if not work:
                        return None
                    break  # flushing: no more backoff waits, one failure ends it
                if work and now >= retry_at:
                    break
                self._cond.wait(timeout=max(0.0, retry_at - now) if work else None)
            batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            self._inflight = len(batch)
            return batch

    def _give_back(self, batch: list[wire.TrainerReport]) -> None:
        """Put a failed batch back at the head, oldest dropped beyond the bound."""
        with self._cond:
            self._inflight = 0
            room = self._queue_size - len(self._queue)
            keep = batch[-room:] if room > 0 else []
            self.dropped += len(batch) - len(keep)
            self._queue.extendleft(reversed(keep))

    def _run(self) -> None:
        retry_at = 0.0
        down_logged = False
        while True:
            batch = self._take(retry_at)
            if batch is None:
                return
            register = self._register_pending
            pipe = self._redis.pipeline(transaction=False)
            if register:
                pipe.xadd(
                    wire.REGISTRATION_STREAM,
                    {wire.REGISTRATION_FIELD: wire.encode(self.registration)},
                    maxlen=self.maxlen,
                    approximate=True,
                )
            for rep in batch:
                pipe.xadd(
                    wire.TRAINER_STREAM,
                    {wire.TRAINER_FIELD: wire.encode(rep)},
                    maxlen=self.maxlen,
                    approximate=True,
                )
            try:
                pipe.execute()
            except Exception as exc:
                if is_transient(exc):
                    self.failures += 1
                    delay = self._backoff.next_delay()
                    retry_at = time.monotonic() + delay
                    if not down_logged:
                        log.warning(
                            "event=redis_unavailable job=%s rank=%d error=%r retry_in_s=%.2f",
                            self.job,
                            self.rank,
                            exc,
                            delay,
                        )
                        down_logged = True
                    self._give_back(batch)
                    if self._closing:
                        return
                    continue
                log.error(
                    "event=reports_rejected job=%s rank=%d count=%d error=%r", self.job, self.rank, len(batch), exc
                )
                with self._cond:
                    self._inflight = 0
                    self._register_pending = False
                    self.rejected += len(batch)
                continue
            if down_logged:
                log.info("event=redis_reconnected job=%s rank=%d failures=%d", self.job, self.rank, self.failures)
                down_logged = False
            self._backoff.reset()
            retry_at = 0.0
            with self._cond:
                self._inflight = 0
                self._register_pending = False
                self.published += len(batch)
            # At most one round trip per linger: the steps in between ride the next batch, so a
            # fast training loop does not pay a thread wake-up and a socket write per step.
            if self.linger_s > 0:
                self._closed.wait(self.linger_s)
