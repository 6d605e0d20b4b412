"""The NVML GPU source: reads every GPU of the node through nvidia-ml-py (``pynvml``).

:class:`NvmlSource` (the agent's GPU source interface: ``name``, ``open``, ``sample``, ``close``):

* importing this module and constructing the source touch no hardware and do not import
  ``pynvml``; :meth:`NvmlSource.open` does, and raises :class:`NvmlUnavailable` saying what is
  missing (the library, the driver, the permission);
* :meth:`NvmlSource.sample` never raises an NVML error: one :class:`GpuSample` per GPU, in index
  order; an unsupported field is ``None`` (no error), a failed one ``None`` and named in
  ``error``, a lost GPU ``lost=True``; the other GPUs are read regardless;
* XIDs come from NVML's critical-XID events, drained at each sample: ``xid_counts`` cumulative,
  ``xids_recent`` those seen within ``xid_window_s``;
* handles and static fields are cached, and fetched again after a failure.

Each outcome in detail, and why health compares the PCIe width and not the generation:
docs/design/nvml.md.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from clusterpulse.wire import GpuSample, ThrottleReason

log = logging.getLogger(__name__)

_ERROR_MAX = 512  # GpuSample.error max_length
_LABEL_MAX = 128  # GpuSample.uuid / name max_length
_MAX_EVENTS_PER_SAMPLE = 4096  # bounds the drain loop against an event storm
_EVENT_REASONS = "nvmlDeviceGetCurrentClocksEventReasons"  # R535+
_THROTTLE_REASONS = "nvmlDeviceGetCurrentClocksThrottleReasons"  # its deprecated predecessor

# Clock event ("throttle") reason bits, nvml.h ABI: identical for nvmlClocksEventReason* and the
# deprecated nvmlClocksThrottleReason*; the tests check them against pynvml's constants.
_REASON_BITS: Final[tuple[tuple[int, ThrottleReason], ...]] = (
    (0x0000000000000040, "thermal"),  # HwThermalSlowdown
    (0x0000000000000020, "thermal"),  # SwThermalSlowdown
    (0x0000000000000080, "power_brake"),  # HwPowerBrakeSlowdown
    (0x0000000000000008, "hw_slowdown"),  # HwSlowdown
    (0x0000000000000004, "sw_power_cap"),  # SwPowerCap
)
_REASON_ORDER: Final[tuple[ThrottleReason, ...]] = ("thermal", "power_brake", "hw_slowdown", "sw_power_cap")


def throttle_reasons(mask: int) -> tuple[ThrottleReason, ...]:
    """Map an NVML clock-event-reason bit mask to wire reasons, in ``THROTTLE_REASONS`` order.

    Bits without a wire meaning (GPU idle, application clocks, sync boost, display clock...) are
    ignored: they are not faults.
    """
    active = {reason for bit, reason in _REASON_BITS if mask & bit}
    return tuple(r for r in _REASON_ORDER if r in active)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this node (no library, no driver, no permission, no pynvml)."""


class _GpuLost(Exception):
    """Internal: an NVML call of one GPU answered NVML_ERROR_GPU_IS_LOST."""

    def __init__(self, call: str, error: BaseException) -> None:
        super().__init__(f"{call}: {error}")
        self.call = call


class _FieldError(Exception):
    """Internal: an NVML call of one field failed with an error that is not 'not supported'."""


@dataclass
class _Gpu:
    """What the source keeps about one GPU between samples."""

    index: int
    handle: Any = None
    handle_key: object = None
    uuid: str = ""
    name: str = ""
    cache: dict[str, Any] = field(default_factory=dict)  # static fields read once; absent: unread
    events_registered: bool = False
    problem: str | None = None  # the last sample's error ("lost" when lost), logged on change
    xid_counts: dict[int, int] = field(default_factory=dict)
    xid_last_seen: dict[int, float] = field(default_factory=dict)


def _handle_key(handle: Any) -> object:
    """A value that is equal for two handles of the same device.

    Real handles are ctypes pointers: each call returns a new Python object holding the same
    address, so compare addresses. Other handles (fakes) are compared as objects.
    """
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _FieldReader:
    """The per-field NVML readers: which call reads each field of a :class:`GpuSample`, in which
    units, and what each call's errors mean (docs/design/nvml.md): 'not supported' is
    ``None``; another error is ``None`` and named in ``errors``; ``GPU_IS_LOST`` raises
    :class:`_GpuLost`. Fields that never change are read once into the GPU's cache, and the
    clock-reasons call falls back once, for good, to its pre-R535 name.

    ``nvml`` is the source's pynvml-like module (:class:`NvmlSource` sets it when :meth:`NvmlSource.open`
    imports the real one).
    """

    def __init__(self, nvml: Any) -> None:
        self.nvml: Any = nvml
        self._reasons_call = _EVENT_REASONS

    def read(self, gpu: _Gpu, errors: list[str]) -> dict[str, Any]:
        """Every measured field of an attached GPU, as ``GpuSample`` keyword arguments; refreshes
        its uuid and name (cached) and appends what failed to ``errors``."""
        nvml = self.nvml

        def call(fn: str, *args: Any) -> Any:
            try:
                return self._call(gpu, fn, *args)
            except _FieldError as err:
                errors.append(str(err))
                return None

        util = call("nvmlDeviceGetUtilizationRates")
        utilization = None
        if util is not None:
            utilization = self._in_range(errors, "utilization", util.gpu / 100.0, 0.0, 1.0)
        mem = call("nvmlDeviceGetMemoryInfo")
        temp = call("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        power_mw = call("nvmlDeviceGetPowerUsage")
        limit_mw = call("nvmlDeviceGetEnforcedPowerLimit")
        sm_clock = call("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM)
        reasons = self._reasons(gpu, errors)
        corrected, uncorrected = (
            nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        )
        volatile, aggregate = nvml.NVML_VOLATILE_ECC, nvml.NVML_AGGREGATE_ECC
        ecc_vc = call("nvmlDeviceGetTotalEccErrors", corrected, volatile)
        ecc_vu = call("nvmlDeviceGetTotalEccErrors", uncorrected, volatile)
        ecc_ac = call("nvmlDeviceGetTotalEccErrors", corrected, aggregate)
        ecc_au = call("nvmlDeviceGetTotalEccErrors", uncorrected, aggregate)
        width = call("nvmlDeviceGetCurrPcieLinkWidth")
        gen = call("nvmlDeviceGetCurrPcieLinkGeneration")
        width_max = self._cached(gpu, "width_max", errors, "nvmlDeviceGetMaxPcieLinkWidth")
        gen_max = self._cached(gpu, "gen_max", errors, "nvmlDeviceGetMaxPcieLinkGeneration")
        nvlink_up, nvlink_total = self._nvlink(gpu, errors)
        recovery = self._recovery(gpu, errors)
        self.labels(gpu, errors)  # cached: a dict lookup unless they failed at attach
        temperature = None if temp is None else self._in_range(errors, "temperature", float(temp), -50.0, 200.0)
        return {
            "utilization_ratio": utilization,
            "memory_used_bytes": None if mem is None else int(mem.used),
            "memory_total_bytes": None if mem is None else int(mem.total),
            "temperature_celsius": temperature,
            "power_watts": None if power_mw is None else power_mw / 1000.0,
            "power_limit_watts": None if limit_mw is None else limit_mw / 1000.0,
            "sm_clock_mhz": None if sm_clock is None else float(sm_clock),
            "throttle": () if reasons is None else throttle_reasons(int(reasons)),
            "ecc_volatile_corrected": ecc_vc,
            "ecc_volatile_uncorrected": ecc_vu,
            "ecc_aggregate_corrected": ecc_ac,
            "ecc_aggregate_uncorrected": ecc_au,
            "pcie_link_width": width,
            "pcie_link_width_max": width_max,
            "pcie_link_gen": gen,
            "pcie_link_gen_max": gen_max,
            "recovery_action": recovery,
            "nvlink_up": nvlink_up,
            "nvlink_total": nvlink_total,
        }

    def labels(self, gpu: _Gpu, errors: list[str]) -> None:
        """The GPU's uuid and name, read once (clipped to the wire's length)."""
        uuid = self._cached(gpu, "uuid", errors, "nvmlDeviceGetUUID")
        name = self._cached(gpu, "name", errors, "nvmlDeviceGetName")
        gpu.uuid = _clip(str(uuid), _LABEL_MAX) if uuid is not None else ""
        gpu.name = _clip(str(name), _LABEL_MAX) if name is not None else ""

    def _call(self, gpu: _Gpu, fn: str, *args: Any) -> Any:
        """One NVML call on ``gpu``: the value, or ``None`` if not supported; see :meth:`_classify`."""
        nvml = self.nvml
        try:
            return getattr(nvml, fn)(gpu.handle, *args)
        except nvml.NVMLError as err:
            self._classify(fn, err)
            return None

    def _classify(self, fn: str, err: Any) -> None:
        """Return for 'not supported', raise :class:`_GpuLost` or :class:`_FieldError` otherwise."""
        nvml = self.nvml
        if isinstance(err, nvml.NVMLError_GpuIsLost):
            raise _GpuLost(fn, err) from err
        if isinstance(err, (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound)):
            return
        raise _FieldError(f"{fn}: {err}") from err

    def _recovery(self, gpu: _Gpu, errors: list[str]) -> int | None:
        """The driver's recovery action for the GPU (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, R550
        drivers and later: 0 none, 1 GPU reset, 2 node reboot, ...); None where it reports none.
        A driver or pynvml that does not know the field says so for good: asked once."""
        nvml = self.nvml
        fid = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if fid is None or gpu.cache.get("recovery") is False:
            return None
        try:
            values = self._call(gpu, "nvmlDeviceGetFieldValues", [fid])
        except _FieldError as err:
            errors.append(str(err))
            return None
        if not values or int(values[0].nvmlReturn) != nvml.NVML_SUCCESS:
            gpu.cache["recovery"] = False
            return None
        return int(values[0].value.uiVal)

    def _cached(self, gpu: _Gpu, key: str, errors: list[str], fn: str) -> Any:
        """A field read once: cached on success or 'not supported', read again after an error."""
        if key in gpu.cache:
            return gpu.cache[key]
        try:
            value = self._call(gpu, fn)
        except _FieldError as err:
            errors.append(str(err))
            return None
        gpu.cache[key] = value
        return value

    def _in_range(self, errors: list[str], what: str, value: float, lo: float, hi: float) -> float | None:
        # A value out of the wire's range would get the whole heartbeat rejected: drop the field.
        if lo <= value <= hi:
            return value
        errors.append(f"{what}={value!r} outside [{lo}, {hi}]")
        return None

    def _reasons(self, gpu: _Gpu, errors: list[str]) -> Any:
        """Current clock-event reason mask, falling back to the pre-R535 "throttle reasons" call."""
        nvml = self.nvml
        if self._reasons_call == _EVENT_REASONS and not hasattr(nvml, _EVENT_REASONS):
            self._reasons_call = _THROTTLE_REASONS  # an older nvidia-ml-py
        fn = self._reasons_call
        try:
            return getattr(nvml, fn)(gpu.handle)
        except nvml.NVMLError as err:
            if fn == _EVENT_REASONS and isinstance(err, nvml.NVMLError_FunctionNotFound):
                log.info("nvml driver lacks %s, using %s", _EVENT_REASONS, _THROTTLE_REASONS)
                self._reasons_call = _THROTTLE_REASONS  # an older driver
                return self._reasons(gpu, errors)
            try:
                self._classify(fn, err)
            except _FieldError as field_err:
                errors.append(str(field_err))
            return None

    def _nvlink(self, gpu: _Gpu, errors: list[str]) -> tuple[int | None, int | None]:
        """(links up, links present); (None, None) when the GPU has no NVLink.

        The number of links is probed once: links 0.. until NOT_SUPPORTED / INVALID_ARGUMENT.
        """
        nvml = self.nvml
        total = gpu.cache.get("nvlink_total")
        probing = "nvlink_total" not in gpu.cache
        limit = int(nvml.NVML_NVLINK_MAX_LINKS) if probing else (total or 0)
        up = 0
        links = 0
        for link in range(limit):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except nvml.NVMLError as err:
                if isinstance(err, nvml.NVMLError_GpuIsLost):
                    raise _GpuLost("nvmlDeviceGetNvLinkState", err) from err
                if probing and isinstance(
                    err,
                    (
                        nvml.NVMLError_NotSupported,
                        nvml.NVMLError_InvalidArgument,
                        nvml.NVMLError_FunctionNotFound,
                    ),
                ):
                    break
                errors.append(f"nvmlDeviceGetNvLinkState(link={link}): {err}")
                return None, total
            links += 1
            if state == nvml.NVML_FEATURE_ENABLED:
                up += 1
        if probing:
            gpu.cache["nvlink_total"] = links or None
            total = links or None
        if not total:
            return None, None
        return up, total


class NvmlSource:
    """The node's GPUs through NVML. The contract: docs/design/nvml.md.

    ``nvml`` is a module-like object with the pynvml API (the real ``pynvml`` when ``None``,
    imported by :meth:`open`; :class:`tests.fake_nvml.FakeNvml` in tests). ``clock`` times the
    XID window only (monotonic seconds). Not thread-safe: one agent loop owns it.

    It owns NVML's lifecycle, the per-GPU sampling loop (attaching, lost GPUs, errors, logging) and
    the XID events; what each field's call is and what its errors mean is :class:`_FieldReader`'s.
    """

    name = "nvml"

    def __init__(
        self,
        *,
        nvml: Any = None,
        xid_window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not xid_window_s > 0:
            raise ValueError(f"xid_window_s={xid_window_s!r}: expected a positive number of seconds")
        self._nvml: Any = nvml
        self._xid_window_s = xid_window_s
        self._clock = clock
        self._open = False
        self._gpus: list[_Gpu] = []
        self._event_set: Any = None
        self._fields = _FieldReader(nvml)
        self._last_event_error: str | None = None
        self._xids: dict[int, tuple[dict[int, int], dict[int, float]]] = {}  # survives reopen
        self.driver_version: str | None = None
        self.xid_events_supported = False

    # --- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        """Initialise NVML, find the GPUs and register for critical-XID events.

        Raises :class:`NvmlUnavailable` when NVML cannot be used at all. Errors of single GPUs
        are not raised: those GPUs are retried and reported by :meth:`sample`. Idempotent.
        """
        if self._open:
            return
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"the nvidia-ml-py package (module pynvml) is not installed: {exc}") from exc
            self._nvml = self._fields.nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise NvmlUnavailable(self._init_message(err)) from err
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            self._shutdown()
            raise NvmlUnavailable(f"NVML initialised but nvmlDeviceGetCount failed: {err}") from err
        self._open = True
        try:
            self.driver_version = str(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as err:
            log.warning("nvml driver_version unreadable error=%r", str(err))
        self._event_set = None
        self.xid_events_supported = False
        try:
            self._event_set = nvml.nvmlEventSetCreate()
            self.xid_events_supported = True
        except nvml.NVMLError as err:
            # Not fatal: GPUs are still read; XIDs are simply not reported.
            log.warning("nvml events unavailable call=nvmlEventSetCreate error=%r xids=not_reported", str(err))
        self._gpus = []
        for i in range(count):
            counts, seen = self._xids.setdefault(i, ({}, {}))
            self._gpus.append(_Gpu(index=i, xid_counts=counts, xid_last_seen=seen))
        for gpu in self._gpus:
            try:
                self._attach(gpu)
            except (_GpuLost, nvml.NVMLError) as err:
                log.warning("nvml gpu not attached gpu=%d error=%r retry=next_sample", gpu.index, str(err))
        log.info("nvml open gpus=%d driver=%s xid_events=%s", count, self.driver_version, self.xid_events_supported)

    def close(self) -> None:
        """Free the event set and shut NVML down. Idempotent; never raises an NVML error."""
        if not self._open:
            return
        self._open = False
        nvml = self._nvml
        if self._event_set is not None:
            try:
                nvml.nvmlEventSetFree(self._event_set)
            except nvml.NVMLError as err:
                log.warning("nvml close call=nvmlEventSetFree error=%r", str(err))
            self._event_set = None
        self._gpus = []
        self._shutdown()

    def __enter__(self) -> NvmlSource:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shutdown(self) -> None:
        nvml = self._nvml
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as err:
            log.warning("nvml close call=nvmlShutdown error=%r", str(err))

    def _init_message(self, err: Any) -> str:
        nvml = self._nvml
        if isinstance(err, nvml.NVMLError_LibraryNotFound):
            return (
                "NVML library libnvidia-ml.so.1 not found: no NVIDIA driver is installed on this node "
                "(or the library is not on the loader path)"
            )
        if isinstance(err, nvml.NVMLError_DriverNotLoaded):
            return "NVIDIA kernel driver is not loaded (is the nvidia module loaded? see `nvidia-smi`)"
        if isinstance(err, nvml.NVMLError_NoPermission):
            return (
                "no permission to use NVML: the agent cannot open /dev/nvidia* (run it as root or in the video group)"
            )
        if isinstance(err, getattr(nvml, "NVMLError_LibRmVersionMismatch", ())):
            return "NVML library and kernel driver versions differ (driver upgraded without a reboot?)"
        return f"nvmlInit failed: {err}"

    # --- sampling -----------------------------------------------------------------------------

    def sample(self) -> list[GpuSample]:
        """Read every GPU once; what each outcome looks like: docs/design/nvml.md."""
        if not self._open:
            raise RuntimeError("NvmlSource.sample() called before open() or after close()")
        now = self._clock()
        self._drain_events(now)
        return [self._noted(gpu, self._sample_gpu(gpu, now)) for gpu in self._gpus]

    def _noted(self, gpu: _Gpu, sample: GpuSample) -> GpuSample:
        """Log a GPU's trouble when it starts, changes or ends, not at every sample."""
        problem = "lost" if sample.lost else sample.error  # a lost GPU's message names the call
        if problem != gpu.problem:
            if problem is None:
                log.info("nvml gpu ok gpu=%d uuid=%s", gpu.index, gpu.uuid)
            elif sample.lost:
                log.warning("nvml gpu lost gpu=%d uuid=%s error=%r", gpu.index, gpu.uuid, sample.error)
            else:
                log.warning("nvml gpu error gpu=%d uuid=%s error=%r", gpu.index, gpu.uuid, sample.error)
            gpu.problem = problem
        return sample

    def _sample_gpu(self, gpu: _Gpu, now: float) -> GpuSample:
        nvml = self._nvml
        try:
            if gpu.handle is None:
                self._attach(gpu)
            return self._read(gpu, now)
        except _GpuLost as lost:
            gpu.handle = None  # fetched again next time: a reset GPU may come back
            return self._lost_sample(gpu, now, f"GPU is lost (NVML_ERROR_GPU_IS_LOST from {lost.call})")
        except nvml.NVMLError as err:  # only getting the handle lets a raw NVML error through
            gpu.handle = None
            return GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                error=_clip(f"nvmlDeviceGetHandleByIndex: {err}", _ERROR_MAX),
                xid_counts=self._xid_counts(gpu),
                xids_recent=self._xids_recent(gpu, now),
            )
        except Exception as exc:
            # A bug here must not blind the agent to the other GPUs; it is logged with its trace.
            log.exception("nvml gpu sample failed gpu=%d", gpu.index)
            return GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                error=_clip(f"internal error reading GPU: {type(exc).__name__}: {exc}", _ERROR_MAX),
                xid_counts=self._xid_counts(gpu),
            )

    def _lost_sample(self, gpu: _Gpu, now: float, message: str) -> GpuSample:
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            lost=True,
            error=_clip(message, _ERROR_MAX),
            xid_counts=self._xid_counts(gpu),
            xids_recent=self._xids_recent(gpu, now),
        )

    def _attach(self, gpu: _Gpu) -> None:
        """Fetch the handle and the fields that never change; register the GPU for XID events."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        except nvml.NVMLError as err:
            if isinstance(err, nvml.NVMLError_GpuIsLost):
                raise _GpuLost("nvmlDeviceGetHandleByIndex", err) from err
            raise
        gpu.handle = handle
        gpu.handle_key = _handle_key(handle)
        errors: list[str] = []
        self._fields.labels(gpu, errors)
        if errors:
            log.warning("nvml gpu labels unreadable gpu=%d error=%r retry=next_sample", gpu.index, errors)
        if self._event_set is not None and not gpu.events_registered:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as err:
                if isinstance(err, nvml.NVMLError_GpuIsLost):
                    raise _GpuLost("nvmlDeviceRegisterEvents", err) from err
                level = logging.INFO if isinstance(err, nvml.NVMLError_NotSupported) else logging.WARNING
                log.log(level, "nvml xid events not registered gpu=%d error=%r", gpu.index, str(err))
            gpu.events_registered = True  # tried: do not retry every sample

    def _read(self, gpu: _Gpu, now: float) -> GpuSample:
        """An attached GPU's sample: its fields (:class:`_FieldReader`), what failed, its XIDs."""
        errors: list[str] = []
        fields = self._fields.read(gpu, errors)
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            error=_clip("; ".join(errors), _ERROR_MAX) if errors else None,
            xid_counts=self._xid_counts(gpu),
            xids_recent=self._xids_recent(gpu, now),
            **fields,
        )

    # --- XID events ---------------------------------------------------------------------------

    def _drain_events(self, now: float) -> None:
        if self._event_set is None:
            return
        nvml = self._nvml
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                event = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError as err:
                if isinstance(err, nvml.NVMLError_Timeout):
                    self._last_event_error = None
                    return
                # GPU_IS_LOST here means some registered GPU is gone; its own sample says which.
                # Logged once per distinct error, not once per sample.
                if str(err) != self._last_event_error:
                    log.warning("nvml event wait failed error=%r", str(err))
                    self._last_event_error = str(err)
                return
            if not int(event.eventType) & int(nvml.nvmlEventTypeXidCriticalError):
                continue
            self._record_xid(event.device, int(event.eventData), now)
        log.warning("nvml event drain stopped after %d events this sample", _MAX_EVENTS_PER_SAMPLE)

    def _record_xid(self, device: Any, xid: int, now: float) -> None:
        gpu = self._gpu_of(device)
        if gpu is None:
            log.error("nvml xid from unknown device xid=%d dropped", xid)
            return
        gpu.xid_counts[xid] = gpu.xid_counts.get(xid, 0) + 1
        gpu.xid_last_seen[xid] = now
        log.warning("nvml xid gpu=%d uuid=%s xid=%d count=%d", gpu.index, gpu.uuid, xid, gpu.xid_counts[xid])

    def _gpu_of(self, device: Any) -> _Gpu | None:
        key = _handle_key(device)
        for gpu in self._gpus:
            if gpu.handle_key is not None and gpu.handle_key == key:
                return gpu
        nvml = self._nvml
        try:  # the handle was not cached (GPU not attached yet): ask NVML
            index = int(nvml.nvmlDeviceGetIndex(device))
        except nvml.NVMLError:
            return None
        return self._gpus[index] if 0 <= index < len(self._gpus) else None

    def _xid_counts(self, gpu: _Gpu) -> dict[str, int]:
        return {str(x): n for x, n in sorted(gpu.xid_counts.items())}

    def _xids_recent(self, gpu: _Gpu, now: float) -> tuple[int, ...]:
        for xid in [x for x, t in gpu.xid_last_seen.items() if now - t >= self._xid_window_s]:
            del gpu.xid_last_seen[xid]
        return tuple(sorted(gpu.xid_last_seen))
