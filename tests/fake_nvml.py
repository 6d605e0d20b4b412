"""A fake NVML at the hardware boundary, with pynvml's interface, for the tests.

:class:`FakeNvml` is a drop-in for the ``pynvml`` module as :class:`agent.nvml.NvmlSource` uses it
(``NvmlSource(nvml=FakeNvml())``). It is honest where it matters to code under test:

* its functions have pynvml's names and signatures (a unit test checks every public ``nvml*`` /
  ``NVML*`` name against the real module) and return what pynvml returns: ``str`` for names and
  UUIDs, the real ctypes structures (``c_nvmlUtilization_t``, ``c_nvmlMemory_t``,
  ``c_nvmlEventData_t``), plain ints with NVML's units (milliwatts, MHz, bytes, Celsius);
* errors are the *real* pynvml exception classes, re-exported here (``NVMLError_GpuIsLost`` ...);
* handles are real ``c_nvmlDevice_t`` pointers that point nowhere: opaque, a new Python object per
  ``nvmlDeviceGetHandleByIndex`` call holding the same address (like the real library), so code
  that compares handles by identity fails here as it would on hardware;
* every call before ``nvmlInit`` or after the last ``nvmlShutdown`` raises
  ``NVMLError_Uninitialized``; ``nvmlShutdown`` without init raises it too;
* events are delivered only to event sets that registered the GPU for that event type;
  ``nvmlEventSetWait_v2`` returns queued events, then raises ``NVMLError_GpuIsLost`` if a
  registered GPU is lost, else waits up to ``timeoutms`` and raises ``NVMLError_Timeout``.

Controls for tests (all thread-safe; an agent may be sampling in another thread):

* ``fail_next[function_name] = NVMLError_...()``: the next call of that function raises it, once;
* ``FakeGpu.fails[function_name] = NVML_ERROR_...``: every call of it on that GPU raises it;
* :meth:`FakeNvml.inject_xid` (and :meth:`FakeNvml.inject_event`), :meth:`FakeNvml.lose` / :meth:`FakeNvml.recover`,
  :meth:`FakeNvml.set` (any :class:`FakeGpu` field), ``driver_missing=True``;
* ``calls``: how many times each function was called.
"""

from __future__ import annotations

import builtins
import ctypes
import itertools
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import pynvml

MiB = 1024 * 1024

_SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
)
_instances = itertools.count(1)


@dataclass
class FakeGpu:
    """One GPU's state, in NVML's own units. Defaults: an idle H100 SXM5 80GB on an HGX board."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""  # "" -> a stable UUID derived from the FakeNvml's uuid_seed and the index
    utilization_gpu_percent: int = 0
    utilization_memory_percent: int = 0
    memory_total_bytes: int = 81559 * MiB
    memory_used_bytes: int = 535 * MiB
    temperature_celsius: int = 33
    power_usage_mw: int = 72_000
    power_limit_mw: int = 700_000
    sm_clock_mhz: int = 345
    graphics_clock_mhz: int = 345
    memory_clock_mhz: int = 2619
    clocks_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    ecc_enabled: bool = True  # False: the ECC counters answer NOT_SUPPORTED, as with ECC off
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    pcie_link_width: int = 16
    pcie_link_width_max: int = 16
    pcie_link_gen: int = 5
    pcie_link_gen_max: int = 5
    nvlink_links: int = 18  # 0: no NVLink (NOT_SUPPORTED); links >= this: INVALID_ARGUMENT
    recovery_action: int | None = 0  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; None: a pre-R550 driver
    nvlink_down: set[int] = field(default_factory=set)
    events_supported: bool = True
    lost: bool = False  # every call on this GPU raises GPU_IS_LOST, getting the handle included
    fails: dict[str, int] = field(default_factory=dict)  # function name -> NVML_ERROR_* code, every call


@dataclass(eq=False)
class _EventSet:
    """Opaque to callers, like the real ``c_nvmlEventSet_t``."""

    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event type mask
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)  # (gpu, type, data)
    freed: bool = False

    def __repr__(self) -> str:
        return f"<fake nvmlEventSet registered={sorted(self.registered)} freed={self.freed}>"


class _PynvmlNames:
    """pynvml's constants, exception classes and ctypes structures, the very objects (not copies:
    code under test catches ``nvml.NVMLError_GpuIsLost`` and must catch what the real library raises)."""

    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_FEATURE_DISABLED = pynvml.NVML_FEATURE_DISABLED
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_GRAPHICS = pynvml.NVML_CLOCK_GRAPHICS
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_CLOCK_VIDEO = pynvml.NVML_CLOCK_VIDEO
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = pynvml.NVML_AGGREGATE_ECC
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION

    NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_INSUFFICIENT_POWER = pynvml.NVML_ERROR_INSUFFICIENT_POWER
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_ERROR_IRQ_ISSUE = pynvml.NVML_ERROR_IRQ_ISSUE
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_CORRUPTED_INFOROM = pynvml.NVML_ERROR_CORRUPTED_INFOROM
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = pynvml.NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN

    NVMLError = pynvml.NVMLError
    NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NoPermission = pynvml.NVMLError_NoPermission
    NVMLError_AlreadyInitialized = pynvml.NVMLError_AlreadyInitialized
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_InsufficientPower = pynvml.NVMLError_InsufficientPower
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_IrqIssue = pynvml.NVMLError_IrqIssue
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_CorruptedInforom = pynvml.NVMLError_CorruptedInforom
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_ResetRequired = pynvml.NVMLError_ResetRequired
    NVMLError_LibRmVersionMismatch = pynvml.NVMLError_LibRmVersionMismatch
    NVMLError_Unknown = pynvml.NVMLError_Unknown

    nvmlEventTypeSingleBitEccError = pynvml.nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError
    nvmlEventTypePState = pynvml.nvmlEventTypePState
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeClock = pynvml.nvmlEventTypeClock
    nvmlEventTypeNone = pynvml.nvmlEventTypeNone

    nvmlClocksEventReasonGpuIdle = pynvml.nvmlClocksEventReasonGpuIdle
    nvmlClocksEventReasonApplicationsClocksSetting = pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    nvmlClocksEventReasonSwPowerCap = pynvml.nvmlClocksEventReasonSwPowerCap
    nvmlClocksEventReasonHwSlowdown = pynvml.nvmlClocksEventReasonHwSlowdown
    nvmlClocksEventReasonSyncBoost = pynvml.nvmlClocksEventReasonSyncBoost
    nvmlClocksEventReasonSwThermalSlowdown = pynvml.nvmlClocksEventReasonSwThermalSlowdown
    nvmlClocksEventReasonHwThermalSlowdown = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    nvmlClocksEventReasonHwPowerBrakeSlowdown = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    nvmlClocksEventReasonDisplayClockSetting = pynvml.nvmlClocksEventReasonDisplayClockSetting
    nvmlClocksEventReasonNone = pynvml.nvmlClocksEventReasonNone
    nvmlClocksThrottleReasonGpuIdle = pynvml.nvmlClocksThrottleReasonGpuIdle
    nvmlClocksThrottleReasonSwPowerCap = pynvml.nvmlClocksThrottleReasonSwPowerCap
    nvmlClocksThrottleReasonHwSlowdown = pynvml.nvmlClocksThrottleReasonHwSlowdown
    nvmlClocksThrottleReasonSwThermalSlowdown = pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
    nvmlClocksThrottleReasonHwThermalSlowdown = pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
    nvmlClocksThrottleReasonHwPowerBrakeSlowdown = pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
    nvmlClocksThrottleReasonNone = pynvml.nvmlClocksThrottleReasonNone

    c_nvmlDevice_t = pynvml.c_nvmlDevice_t
    c_nvmlEventData_t = pynvml.c_nvmlEventData_t
    c_nvmlUtilization_t = pynvml.c_nvmlUtilization_t
    c_nvmlMemory_t = pynvml.c_nvmlMemory_t
    c_nvmlMemory_v2_t = pynvml.c_nvmlMemory_v2_t


class _FakeDevices:
    """The fake driver's state and the tests' controls over it: the GPUs, the event sets, the init
    count, the one-shot failures and call counts, and how a call resolves a handle to its GPU (raising
    what the real library would). Calls and controls alike hold one re-entrant condition, ``_cond``,
    so a test may drive the fake while an agent samples it in another thread."""

    def __init__(
        self,
        gpus: int | Iterable[FakeGpu] = 8,
        *,
        driver_missing: bool = False,
        uuid_seed: str = "fake",
        driver_version: str = "550.54.15",
        clocks_event_reasons_supported: bool = True,
    ) -> None:
        """``gpus``: a count of default GPUs or the GPUs themselves.

        ``clocks_event_reasons_supported=False`` models a pre-R535 driver, whose library lacks
        ``nvmlDeviceGetCurrentClocksEventReasons`` (FUNCTION_NOT_FOUND).
        """
        self.gpus: list[FakeGpu] = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        for i, gpu in enumerate(self.gpus):
            if not gpu.uuid:
                gpu.uuid = "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"fake-nvml:{uuid_seed}:{i}"))
        self.driver_missing = driver_missing
        self.driver_version = driver_version
        self.clocks_event_reasons_supported = clocks_event_reasons_supported
        self.fail_next: dict[str, BaseException] = {}
        self.calls: Counter[str] = Counter()
        self.xids_injected: list[tuple[int, int]] = []  # (gpu, xid), delivered or not
        self._init_count = 0
        self._event_sets: list[_EventSet] = []
        self._cond = threading.Condition(threading.RLock())
        # Handle addresses: distinct per instance, so a handle of another fake is rejected.
        self._base = 0x7F00_0000_0000 + (next(_instances) << 24)

    # --- controls -----------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self._init_count > 0

    @property
    def live_event_sets(self) -> int:
        """Event sets created and not yet freed."""
        return sum(1 for s in self._event_sets if not s.freed)

    def event_set(self, n: int = 0) -> _EventSet:
        """The ``n``-th event set created, as ``nvmlEventSetCreate`` handed it out (a test registers
        more event types on the set the source under test uses)."""
        return self._event_sets[n]

    def inject_xid(self, gpu: int, xid: int) -> None:
        """The driver reports XID ``xid`` on GPU ``gpu`` (a critical-XID event)."""
        with self._cond:
            self.xids_injected.append((gpu, xid))
        self.inject_event(gpu, pynvml.nvmlEventTypeXidCriticalError, xid)

    def inject_event(self, gpu: int, event_type: int, data: int = 0) -> None:
        """Queue an event to every live event set that registered ``gpu`` for ``event_type``.

        Like the driver, an event nobody registered for is dropped.
        """
        self._check_index(gpu)
        with self._cond:
            for es in self._event_sets:
                if not es.freed and es.registered.get(gpu, 0) & event_type:
                    es.queue.append((gpu, event_type, data))
            self._cond.notify_all()

    def lose(self, gpu: int) -> None:
        """GPU ``gpu`` falls off the bus: every call on it raises NVMLError_GpuIsLost."""
        self.set(gpu, lost=True)

    def recover(self, gpu: int) -> None:
        """GPU ``gpu`` answers again (as after a reset)."""
        self.set(gpu, lost=False)

    def set(self, gpu: int, **values: Any) -> None:
        """Change fields of GPU ``gpu``, e.g. ``set(0, temperature_celsius=91, pcie_link_width=8)``."""
        self._check_index(gpu)
        known = {f.name for f in fields(FakeGpu)}
        unknown = sorted(builtins.set(values) - known)
        if unknown:
            raise TypeError(f"FakeGpu has no field(s) {unknown}; known: {sorted(known)}")
        with self._cond:
            for key, value in values.items():
                setattr(self.gpus[gpu], key, value)

    def _check_index(self, gpu: int) -> None:
        if not 0 <= gpu < len(self.gpus):
            raise IndexError(f"gpu={gpu}: this FakeNvml has GPUs 0..{len(self.gpus) - 1}")

    # --- plumbing -----------------------------------------------------------------------------

    def _enter(self, fn: str) -> None:
        """Count the call, fire a one-shot failure, refuse if NVML is not initialised."""
        self.calls[fn] += 1
        err = self.fail_next.pop(fn, None)
        if err is not None:
            raise err
        if self._init_count == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(self._base + index * 0x1000), pynvml.c_nvmlDevice_t)

    def _gpu(self, fn: str, handle: Any) -> tuple[int, FakeGpu]:
        """Enter ``fn`` and resolve ``handle`` to its GPU, raising what the real library would."""
        self._enter(fn)
        if not isinstance(handle, pynvml.c_nvmlDevice_t):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        address = ctypes.cast(handle, ctypes.c_void_p).value or 0
        offset = address - self._base
        index, rest = divmod(offset, 0x1000)
        if offset < 0 or rest or index >= len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, self._check_gpu(fn, index)

    def _check_gpu(self, fn: str, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        code = gpu.fails.get(fn)
        if code is not None:
            raise pynvml.NVMLError(code)
        return gpu

    def _event_set(self, event_set: Any) -> _EventSet:
        known = any(es is event_set for es in self._event_sets)
        if not isinstance(event_set, _EventSet) or not known or event_set.freed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set


class FakeNvml(_PynvmlNames, _FakeDevices):
    """A module-like fake of pynvml over a list of :class:`FakeGpu`: pynvml's names
    (:class:`_PynvmlNames`) and its calls, answered from the state and controls of
    :class:`_FakeDevices`. See the module docstring."""

    # --- library ------------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._cond:
            self.calls["nvmlInitWithFlags"] += 1
            err = self.fail_next.pop("nvmlInitWithFlags", None) or self.fail_next.pop("nvmlInit", None)
            if err is not None:
                raise err
            if self.driver_missing:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            self._init_count += 1

    def nvmlInit(self) -> None:
        """Like pynvml: ``nvmlInitWithFlags(0)``; ``fail_next["nvmlInit"]`` fires here too."""
        self.calls["nvmlInit"] += 1
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        with self._cond:
            self._enter("nvmlShutdown")
            self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._cond:
            self._enter("nvmlSystemGetDriverVersion")
            return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        with self._cond:
            self._enter("nvmlSystemGetNVMLVersion")
            return "12." + self.driver_version

    # --- devices ------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        with self._cond:
            self._enter("nvmlDeviceGetCount")
            return len(self.gpus)  # a lost GPU still counts, as on real nodes

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._cond:
            self._enter("nvmlDeviceGetHandleByIndex")
            if not 0 <= index < len(self.gpus):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            self._check_gpu("nvmlDeviceGetHandleByIndex", index)
            return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        with self._cond:
            self._enter("nvmlDeviceGetHandleByUUID")
            for i, gpu in enumerate(self.gpus):
                if gpu.uuid == uuid:
                    self._check_gpu("nvmlDeviceGetHandleByUUID", i)
                    return self._handle(i)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        with self._cond:
            index, _ = self._gpu("nvmlDeviceGetIndex", handle)
            return index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._cond:
            return self._gpu("nvmlDeviceGetUUID", handle)[1].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._cond:
            return self._gpu("nvmlDeviceGetName", handle)[1].name

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)[1]
            return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization_gpu_percent, memory=gpu.utilization_memory_percent)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)[1]
            total, used = gpu.memory_total_bytes, gpu.memory_used_bytes
            if not version:
                return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
            return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetTemperature", handle)[1]
            if sensor != pynvml.NVML_TEMPERATURE_GPU:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return gpu.temperature_celsius

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetPowerUsage", handle)[1].power_usage_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle)[1].power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetPowerManagementLimit", handle)[1].power_limit_mw

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetClockInfo", handle)[1]
            clocks = {
                pynvml.NVML_CLOCK_GRAPHICS: gpu.graphics_clock_mhz,
                pynvml.NVML_CLOCK_SM: gpu.sm_clock_mhz,
                pynvml.NVML_CLOCK_MEM: gpu.memory_clock_mhz,
                pynvml.NVML_CLOCK_VIDEO: gpu.graphics_clock_mhz,
            }
            if type not in clocks:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return clocks[type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        with self._cond:
            if not self.clocks_event_reasons_supported:
                self.calls["nvmlDeviceGetCurrentClocksEventReasons"] += 1
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle)[1].clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle)[1].clocks_event_reasons

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetEccMode", handle)[1]
            mode = pynvml.NVML_FEATURE_ENABLED if gpu.ecc_enabled else pynvml.NVML_FEATURE_DISABLED
            return [mode, mode]

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetTotalEccErrors", handle)[1]
            if not gpu.ecc_enabled:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            counters = {
                (
                    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                    pynvml.NVML_VOLATILE_ECC,
                ): gpu.ecc_volatile_corrected,
                (
                    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_VOLATILE_ECC,
                ): gpu.ecc_volatile_uncorrected,
                (
                    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                    pynvml.NVML_AGGREGATE_ECC,
                ): gpu.ecc_aggregate_corrected,
                (
                    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_AGGREGATE_ECC,
                ): gpu.ecc_aggregate_uncorrected,
            }
            if (errorType, counterType) not in counters:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return counters[(errorType, counterType)]

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """As pynvml's: an array of ``c_nvmlFieldValue_t``, each with its own ``nvmlReturn``; this
        fake knows the recovery action alone (NOT_SUPPORTED for any other field, and for it on a
        GPU whose driver predates it)."""
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetFieldValues", handle)[1]
            out = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
            for i, fid in enumerate(fieldIds):
                out[i].fieldId = fid
                known = fid == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None
                out[i].nvmlReturn = pynvml.NVML_SUCCESS if known else pynvml.NVML_ERROR_NOT_SUPPORTED
                out[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                out[i].value.uiVal = gpu.recovery_action or 0
            return out

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", handle)[1].pcie_link_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", handle)[1].pcie_link_width_max

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", handle)[1].pcie_link_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        with self._cond:
            return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", handle)[1].pcie_link_gen_max

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetNvLinkState", device)[1]
            if gpu.nvlink_links == 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if not 0 <= link < gpu.nvlink_links:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            state: int = pynvml.NVML_FEATURE_DISABLED if link in gpu.nvlink_down else pynvml.NVML_FEATURE_ENABLED
            return state

    # --- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        with self._cond:
            self._enter("nvmlEventSetCreate")
            es = _EventSet()
            self._event_sets.append(es)
            return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        with self._cond:
            gpu = self._gpu("nvmlDeviceGetSupportedEventTypes", handle)[1]
            return _SUPPORTED_EVENTS if gpu.events_supported else 0

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._cond:
            index, gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
            es = self._event_set(eventSet)
            if not gpu.events_supported or eventTypes & ~_SUPPORTED_EVENTS:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            es.registered[index] = es.registered.get(index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        with self._cond:
            self._enter("nvmlEventSetWait_v2")
            es = self._event_set(eventSet)
            while True:
                if es.queue:
                    index, event_type, data = es.queue.popleft()
                    event = pynvml.c_nvmlEventData_t()
                    event.device = self._handle(index)
                    event.eventType = event_type
                    event.eventData = data
                    return event
                if any(self.gpus[i].lost for i in es.registered):
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(left)
                es = self._event_set(eventSet)  # freed meanwhile: INVALID_ARGUMENT

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._cond:
            self._enter("nvmlEventSetFree")
            self._event_set(eventSet).freed = True
            self._cond.notify_all()
