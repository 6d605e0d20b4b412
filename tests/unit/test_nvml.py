"""NvmlSource against FakeNvml, and FakeNvml against the real pynvml interface."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.nvml import NvmlSource, NvmlUnavailable, throttle_reasons
from clusterpulse.wire import PROTOCOL_VERSION, GpuSample, Heartbeat, decode_heartbeat, encode
from tests.fake_nvml import FakeGpu, FakeNvml, MiB

# Every per-GPU NVML function the source reads each sample.
PER_SAMPLE_CALLS = (
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetNvLinkState",
)
CACHED_CALLS = (
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(4)


@pytest.fixture
def source(fake: FakeNvml, clock: Clock) -> Iterator[NvmlSource]:
    src = NvmlSource(nvml=fake, xid_window_s=300.0, clock=clock)
    src.open()
    yield src
    src.close()


def roundtrip(samples: list[GpuSample]) -> list[GpuSample]:
    """Through the wire, which validates types and ranges as the orchestrator will."""
    hb = Heartbeat(
        v=PROTOCOL_VERSION, node="n1", boot_id="b", seq=0, sent_at=0.0, interval_s=1.0, gpu_source="nvml", gpus=samples
    )
    return decode_heartbeat(encode(hb)).gpus


# --- field mapping ---------------------------------------------------------------------------


def test_every_field_mapped_with_units(fake: FakeNvml, source: NvmlSource) -> None:
    fake.set(
        2,
        utilization_gpu_percent=87,
        memory_used_bytes=71_234 * MiB,
        temperature_celsius=64,
        power_usage_mw=652_345,
        power_limit_mw=690_000,
        sm_clock_mhz=1980,
        clocks_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap,
        ecc_volatile_corrected=3,
        ecc_volatile_uncorrected=1,
        ecc_aggregate_corrected=17,
        ecc_aggregate_uncorrected=2,
        pcie_link_width=8,
        pcie_link_gen=4,
        nvlink_down={0, 5},
    )
    (g,) = [s for s in source.sample() if s.index == 2]
    assert g == GpuSample(
        index=2,
        uuid=fake.gpus[2].uuid,
        name="NVIDIA H100 80GB HBM3",
        utilization_ratio=0.87,
        memory_used_bytes=71_234 * 1024 * 1024,
        memory_total_bytes=81_559 * 1024 * 1024,
        temperature_celsius=64.0,
        power_watts=652.345,
        power_limit_watts=690.0,
        sm_clock_mhz=1980.0,
        throttle=("sw_power_cap",),
        ecc_volatile_corrected=3,
        ecc_volatile_uncorrected=1,
        ecc_aggregate_corrected=17,
        ecc_aggregate_uncorrected=2,
        pcie_link_width=8,
        pcie_link_width_max=16,
        pcie_link_gen=4,
        pcie_link_gen_max=5,
        nvlink_up=16,
        nvlink_total=18,
        recovery_action=0,  # an R550+ driver: nothing to recover
    )
    assert g.uuid.startswith("GPU-")


def test_defaults_are_an_idle_h100_and_pass_the_wire(fake: FakeNvml, source: NvmlSource) -> None:
    samples = source.sample()
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert len({s.uuid for s in samples}) == 4
    for s in roundtrip(samples):
        assert s.error is None and not s.lost
        assert s.power_limit_watts == 700.0
        assert s.throttle == ()  # GPU idle is a clock event reason, not a fault
        assert (s.pcie_link_width, s.pcie_link_gen_max, s.nvlink_up, s.nvlink_total) == (16, 5, 18, 18)


def test_not_supported_fields_are_none_not_zero(fake: FakeNvml, source: NvmlSource) -> None:
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    calls = [c for c in PER_SAMPLE_CALLS if c != "nvmlDeviceGetNvLinkState"]
    fake.set(
        1,
        fails={
            c: not_supported for c in [*calls, "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration"]
        },
    )
    fresh = NvmlSource(nvml=FakeNvml([FakeGpu(ecc_enabled=False, nvlink_links=0)]))
    fresh.open()
    (no_ecc,) = fresh.sample()
    fresh.close()
    assert (no_ecc.ecc_volatile_corrected, no_ecc.ecc_aggregate_uncorrected) == (None, None)
    assert (no_ecc.nvlink_up, no_ecc.nvlink_total) == (None, None)
    assert no_ecc.error is None and no_ecc.temperature_celsius == 33.0

    # GPU 1 had its max PCIe fields cached at open; a fresh source sees them unsupported too.
    fresh = NvmlSource(nvml=fake)
    fake.set(1, nvlink_links=0)
    fresh.open()
    g = fresh.sample()[1]
    fresh.close()
    assert g.error is None and not g.lost
    assert g.uuid and g.name
    for name in (
        "utilization_ratio",
        "memory_used_bytes",
        "memory_total_bytes",
        "temperature_celsius",
        "power_watts",
        "power_limit_watts",
        "sm_clock_mhz",
        "ecc_volatile_corrected",
        "ecc_volatile_uncorrected",
        "ecc_aggregate_corrected",
        "ecc_aggregate_uncorrected",
        "pcie_link_width",
        "pcie_link_width_max",
        "pcie_link_gen",
        "pcie_link_gen_max",
        "nvlink_up",
        "nvlink_total",
    ):
        assert getattr(g, name) is None, name
    assert g.throttle == ()
    roundtrip([g])


def test_mig_style_utilization_not_supported_leaves_the_rest(fake: FakeNvml, source: NvmlSource) -> None:
    fake.set(0, fails={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_NOT_SUPPORTED})
    g = source.sample()[0]
    assert g.utilization_ratio is None and g.error is None
    assert g.power_watts == 72.0


def test_nvlink_probe_stops_at_invalid_argument_and_is_cached(fake: FakeNvml, source: NvmlSource) -> None:
    # Probed at the first sample: 18 links answer, link 18 says INVALID_ARGUMENT.
    source.sample()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 4 * 19
    fake.set(3, nvlink_down={17})
    assert source.sample()[3].nvlink_up == 17
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 4 * 19 + 4 * 18  # no probing past the known links


# --- errors ----------------------------------------------------------------------------------


def test_lost_gpu_is_reported_and_the_others_still_read(fake: FakeNvml, source: NvmlSource) -> None:
    fake.lose(1)
    samples = source.sample()
    lost = samples[1]
    assert lost.lost is True
    assert lost.error is not None and "GPU_IS_LOST" in lost.error
    assert lost.uuid == fake.gpus[1].uuid  # cached, still useful to the operator
    assert lost.power_watts is None and lost.memory_total_bytes is None
    assert all(not s.lost and s.error is None and s.power_watts == 72.0 for i, s in enumerate(samples) if i != 1)
    roundtrip(samples)

    # Still lost: the handle is fetched again and that fails too.
    assert source.sample()[1].lost
    assert fake.calls["nvmlDeviceGetHandleByIndex"] >= 4 + 1

    fake.recover(1)
    back = source.sample()[1]
    assert not back.lost and back.error is None and back.power_watts == 72.0


def test_gpu_lost_before_open(clock: Clock) -> None:
    fake = FakeNvml(2)
    fake.lose(0)
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()  # one lost GPU does not make NVML unavailable
    g0, g1 = src.sample()
    assert g0 == GpuSample(index=0, lost=True, error=g0.error)
    assert g0.error is not None and "nvmlDeviceGetHandleByIndex" in g0.error
    assert not g1.lost and g1.error is None
    fake.recover(0)
    g0 = src.sample()[0]
    assert not g0.lost and g0.uuid == fake.gpus[0].uuid
    src.close()


def test_gpu_lost_midway_through_a_sample(fake: FakeNvml, source: NvmlSource) -> None:
    fake.set(2, fails={"nvmlDeviceGetCurrPcieLinkWidth": pynvml.NVML_ERROR_GPU_IS_LOST})
    g = source.sample()[2]
    assert g.lost and g.error is not None and "nvmlDeviceGetCurrPcieLinkWidth" in g.error
    assert g.power_watts is None  # a lost sample carries no half-read numbers


def test_one_shot_error_on_one_call(fake: FakeNvml, source: NvmlSource) -> None:
    fake.fail_next["nvmlDeviceGetPowerUsage"] = pynvml.NVMLError_Unknown()
    first = source.sample()
    g0 = first[0]
    assert g0.power_watts is None
    assert g0.error == "nvmlDeviceGetPowerUsage: Unknown Error"
    assert not g0.lost and g0.temperature_celsius == 33.0 and g0.power_limit_watts == 700.0
    assert all(s.error is None and s.power_watts == 72.0 for s in first[1:])
    assert "nvmlDeviceGetPowerUsage" not in fake.fail_next
    again = source.sample()[0]
    assert again.error is None and again.power_watts == 72.0


def test_one_shot_error_on_a_cached_field_is_read_again(clock: Clock) -> None:
    fake = FakeNvml(1)
    fake.fail_next["nvmlDeviceGetMaxPcieLinkWidth"] = pynvml.NVMLError_Unknown()
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    g = src.sample()[0]
    assert g.pcie_link_width_max is None and g.error is not None and "MaxPcieLinkWidth" in g.error
    assert src.sample()[0].pcie_link_width_max == 16  # not cached as None
    src.close()


def test_handle_error_at_open_is_retried(clock: Clock) -> None:
    fake = FakeNvml(2)
    fake.fail_next["nvmlDeviceGetHandleByIndex"] = pynvml.NVMLError_Unknown()
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    samples = src.sample()
    assert [s.error for s in samples] == [None, None]
    assert samples[0].uuid == fake.gpus[0].uuid
    src.close()


def test_whole_gpu_error_becomes_error_sample(fake: FakeNvml, source: NvmlSource) -> None:
    fake.lose(3)
    source.sample()  # drops the handle of GPU 3
    fake.recover(3)
    fake.set(3, fails={"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_UNKNOWN})
    g = source.sample()[3]
    assert not g.lost
    assert g.error == "nvmlDeviceGetHandleByIndex: Unknown Error"
    assert g.power_watts is None
    assert source.sample()[0].error is None


def test_an_unexpected_field_error_keeps_the_rest_of_the_sample(fake: FakeNvml, source: NvmlSource) -> None:
    fake.set(0, fails={"nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NO_PERMISSION})
    g = source.sample()[0]
    assert g.ecc_volatile_corrected is None and g.ecc_aggregate_uncorrected is None
    assert g.error is not None and g.error.count("nvmlDeviceGetTotalEccErrors: Insufficient Permissions") == 4
    assert g.temperature_celsius == 33.0 and g.nvlink_up == 18


def test_out_of_range_reading_is_dropped_so_the_heartbeat_is_not_rejected(fake: FakeNvml, source: NvmlSource) -> None:
    fake.set(0, temperature_celsius=4_294_967)
    g = source.sample()[0]
    assert g.temperature_celsius is None and g.error is not None and "temperature" in g.error
    roundtrip([g])


def test_sample_never_raises_nvml_errors(fake: FakeNvml, source: NvmlSource) -> None:
    for fn in (*PER_SAMPLE_CALLS, "nvmlEventSetWait_v2"):
        fake.fail_next[fn] = pynvml.NVMLError_Unknown()
    samples = source.sample()
    assert len(samples) == 4
    assert samples[0].error is not None and not samples[0].lost
    roundtrip(samples)


def test_sample_before_open_is_a_programming_error(fake: FakeNvml) -> None:
    with pytest.raises(RuntimeError, match="before open"):
        NvmlSource(nvml=fake).sample()


# --- calls are cheap -------------------------------------------------------------------------


def test_static_fields_and_handles_are_cached(fake: FakeNvml, source: NvmlSource) -> None:
    source.sample()
    before = {c: fake.calls[c] for c in (*CACHED_CALLS, "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetCount")}
    assert all(n == 4 for c, n in before.items() if c in CACHED_CALLS)
    for _ in range(3):
        source.sample()
    after = {c: fake.calls[c] for c in before}
    assert after == before
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 4 * 4


# --- throttle reasons ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (0, ()),
        (pynvml.nvmlClocksEventReasonGpuIdle, ()),
        (pynvml.nvmlClocksEventReasonApplicationsClocksSetting | pynvml.nvmlClocksEventReasonSyncBoost, ()),
        (pynvml.nvmlClocksEventReasonHwThermalSlowdown, ("thermal",)),
        (pynvml.nvmlClocksEventReasonSwThermalSlowdown, ("thermal",)),
        (pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSwThermalSlowdown, ("thermal",)),
        (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, ("power_brake",)),
        (pynvml.nvmlClocksEventReasonHwSlowdown, ("hw_slowdown",)),
        (pynvml.nvmlClocksEventReasonSwPowerCap, ("sw_power_cap",)),
        (
            pynvml.nvmlClocksEventReasonSwPowerCap
            | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
            | pynvml.nvmlClocksEventReasonHwSlowdown
            | pynvml.nvmlClocksEventReasonSwThermalSlowdown,
            ("thermal", "power_brake", "hw_slowdown", "sw_power_cap"),
        ),
    ],
)
def test_throttle_reason_mapping(fake: FakeNvml, source: NvmlSource, mask: int, expected: tuple[str, ...]) -> None:
    assert throttle_reasons(mask) == expected
    fake.set(0, clocks_event_reasons=mask)
    assert source.sample()[0].throttle == expected


def test_throttle_bits_match_the_deprecated_constants() -> None:
    for reason in ("SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"):
        bit = getattr(pynvml, f"nvmlClocksEventReason{reason}")
        assert bit == getattr(pynvml, f"nvmlClocksThrottleReason{reason}")
        assert throttle_reasons(bit), reason


def test_old_driver_falls_back_to_throttle_reasons(clock: Clock) -> None:
    fake = FakeNvml(2, clocks_event_reasons_supported=False)
    fake.set(1, clocks_event_reasons=pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown)
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    assert [s.throttle for s in src.sample()] == [(), ("power_brake",)]
    assert [s.error for s in src.sample()] == [None, None]
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # tried once, then not again
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 4
    src.close()


# --- XIDs ------------------------------------------------------------------------------------


def test_xid_counts_are_cumulative_and_the_recent_window_expires(
    fake: FakeNvml, source: NvmlSource, clock: Clock
) -> None:
    fake.inject_xid(0, 79)
    fake.inject_xid(0, 13)
    fake.inject_xid(2, 48)
    s = source.sample()
    assert (s[0].xid_counts, s[0].xids_recent) == ({"13": 1, "79": 1}, (13, 79))
    assert (s[2].xid_counts, s[2].xids_recent) == ({"48": 1}, (48,))
    assert s[1].xid_counts == {} and s[1].xids_recent == ()

    clock.now += 200
    fake.inject_xid(0, 79)
    s = source.sample()
    assert s[0].xid_counts == {"13": 1, "79": 2} and s[0].xids_recent == (13, 79)

    clock.now += 150  # 350 s after XID 13, 150 s after the second XID 79
    s = source.sample()
    assert s[0].xid_counts == {"13": 1, "79": 2}
    assert s[0].xids_recent == (79,)
    assert s[2].xids_recent == () and s[2].xid_counts == {"48": 1}

    clock.now += 150
    s = source.sample()
    assert s[0].xids_recent == () and s[0].xid_counts == {"13": 1, "79": 2}
    roundtrip(s)


def test_xid_before_open_is_not_delivered(clock: Clock) -> None:
    fake = FakeNvml(1)
    fake.inject_xid(0, 48)  # nobody was registered: NVML drops it
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    assert src.sample()[0].xid_counts == {}
    src.close()


def test_xid_79_then_lost_is_attributed_to_the_lost_gpu(fake: FakeNvml, source: NvmlSource) -> None:
    fake.inject_xid(3, 79)  # fallen off the bus ...
    fake.lose(3)  # ... so asking NVML which device the event came from would fail
    s = source.sample()
    assert s[3].lost and s[3].xid_counts == {"79": 1} and s[3].xids_recent == (79,)
    fake.inject_xid(0, 31)
    # While a registered GPU is lost the wait answers GPU_IS_LOST once the queue is empty;
    # the drain stops there and does not spin.
    waits = fake.calls["nvmlEventSetWait_v2"]
    s = source.sample()
    assert s[0].xid_counts == {"31": 1}
    assert fake.calls["nvmlEventSetWait_v2"] == waits + 2


def test_events_not_supported_is_tolerated(clock: Clock) -> None:
    fake = FakeNvml([FakeGpu(events_supported=False), FakeGpu()])
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    fake.inject_xid(0, 48)
    fake.inject_xid(1, 48)
    s = src.sample()
    assert s[0].xid_counts == {} and s[0].error is None
    assert s[1].xid_counts == {"48": 1}
    src.close()


def test_event_set_not_supported_still_reads_gpus(clock: Clock) -> None:
    fake = FakeNvml(2)
    fake.fail_next["nvmlEventSetCreate"] = pynvml.NVMLError_NotSupported()
    src = NvmlSource(nvml=fake, clock=clock)
    src.open()
    assert not src.xid_events_supported
    assert [s.error for s in src.sample()] == [None, None]
    assert fake.calls["nvmlEventSetWait_v2"] == 0
    src.close()


def test_non_xid_events_are_ignored(fake: FakeNvml, source: NvmlSource) -> None:
    # Registered for XIDs only: a P-state event is not even delivered ...
    fake.inject_event(0, pynvml.nvmlEventTypePState, 2)
    assert source.sample()[0].xid_counts == {}
    # ... and one that is (another registration of the same set) is not counted as an XID.
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypePState, fake.event_set(0))
    fake.inject_event(0, pynvml.nvmlEventTypePState, 2)
    waits = fake.calls["nvmlEventSetWait_v2"]
    assert source.sample()[0].xid_counts == {}
    assert fake.calls["nvmlEventSetWait_v2"] == waits + 2


def test_xid_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="xid_window_s"):
        NvmlSource(nvml=FakeNvml(1), xid_window_s=0)


# --- open / close ----------------------------------------------------------------------------


def test_driver_missing_raises_nvml_unavailable_with_a_clear_message() -> None:
    fake = FakeNvml(8, driver_missing=True)
    src = NvmlSource(nvml=fake)
    with pytest.raises(NvmlUnavailable, match="driver is not loaded") as info:
        src.open()
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, pynvml.NVMLError_DriverNotLoaded)
    src.close()  # harmless after a failed open
    assert fake.calls["nvmlShutdown"] == 0


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (pynvml.NVMLError_LibraryNotFound, "libnvidia-ml.so.1 not found"),
        (pynvml.NVMLError_NoPermission, "no permission"),
        (pynvml.NVMLError_LibRmVersionMismatch, "versions differ"),
        (pynvml.NVMLError_Unknown, "nvmlInit failed: Unknown Error"),
    ],
)
def test_init_failures_say_what_is_wrong(error: Any, message: str) -> None:
    fake = FakeNvml(1)
    fake.fail_next["nvmlInit"] = error()
    with pytest.raises(NvmlUnavailable, match=message):
        NvmlSource(nvml=fake).open()


def test_device_count_failure_shuts_nvml_down() -> None:
    fake = FakeNvml(1)
    fake.fail_next["nvmlDeviceGetCount"] = pynvml.NVMLError_Unknown()
    with pytest.raises(NvmlUnavailable, match="nvmlDeviceGetCount"):
        NvmlSource(nvml=fake).open()
    assert not fake.initialized


def test_real_pynvml_without_a_driver_is_unavailable() -> None:
    # This test host has no NVIDIA driver; where one exists the source must open instead.
    src = NvmlSource()
    try:
        src.open()
    except NvmlUnavailable as exc:
        assert str(exc)
    else:
        assert isinstance(src.sample(), list)
    finally:
        src.close()


def test_close_is_idempotent_and_releases_everything(fake: FakeNvml, clock: Clock) -> None:
    src = NvmlSource(nvml=fake, clock=clock)
    src.close()  # before open: nothing to do
    src.open()
    src.open()  # idempotent too
    assert fake.initialized and fake.live_event_sets == 1
    src.close()
    src.close()
    assert not fake.initialized and fake.live_event_sets == 0
    assert fake.calls["nvmlShutdown"] == 1 and fake.calls["nvmlEventSetFree"] == 1
    assert fake.calls["nvmlInit"] == 1


def test_close_tolerates_errors_and_reopen_keeps_xid_counts(fake: FakeNvml, clock: Clock) -> None:
    src = NvmlSource(nvml=fake, clock=clock)
    with src:
        fake.inject_xid(1, 94)
        src.sample()
        fake.fail_next["nvmlEventSetFree"] = pynvml.NVMLError_Unknown()
    assert not fake.initialized
    with src:
        assert src.sample()[1].xid_counts == {"94": 1}


def test_importing_agent_nvml_touches_no_hardware() -> None:
    code = (
        "import sys\n"
        "import agent.nvml as m\n"
        "src = m.NvmlSource()\n"
        "assert 'pynvml' not in sys.modules, 'agent.nvml imported pynvml at import time'\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60, cwd=root
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- the fake does not drift from pynvml -----------------------------------------------------


def _api_names(obj: object) -> list[str]:
    return sorted(n for n in dir(obj) if n.startswith(("nvml", "NVML", "c_nvml")))


def _shape(fn: Any) -> list[tuple[str, Any, bool]]:
    return [
        (p.name, p.kind, p.default is not inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()
    ]


def test_every_fake_name_exists_in_pynvml_with_the_same_signature() -> None:
    fake = FakeNvml(1)
    names = _api_names(fake)
    assert len(names) > 60
    for name in names:
        assert hasattr(pynvml, name), f"FakeNvml.{name} does not exist in pynvml"
        mine, real = getattr(fake, name), getattr(pynvml, name)
        if inspect.isclass(real):
            assert mine is real, f"FakeNvml.{name} must be pynvml's own class"
        elif callable(real):
            assert _shape(mine) == _shape(real), (
                f"FakeNvml.{name}{inspect.signature(mine)} vs pynvml{inspect.signature(real)}"
            )
        else:
            assert mine == real, f"FakeNvml.{name}={mine!r}, pynvml has {real!r}"


def test_fake_handles_and_errors_are_the_real_types() -> None:
    fake = FakeNvml(2)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert h is not fake.nvmlDeviceGetHandleByIndex(1)  # a new object per call, like the real one
    assert fake.nvmlDeviceGetIndex(h) == 1
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    assert isinstance(fake.nvmlDeviceGetUtilizationRates(h), pynvml.c_nvmlUtilization_t)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetUUID(FakeNvml(2)._handle(1))  # another fake's handle
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 0)
    fake.inject_xid(1, 63)
    event = fake.nvmlEventSetWait_v2(es, 10)
    assert isinstance(event, pynvml.c_nvmlEventData_t)
    assert (fake.nvmlDeviceGetIndex(event.device), event.eventType, event.eventData) == (
        1,
        pynvml.nvmlEventTypeXidCriticalError,
        63,
    )
    fake.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlEventSetFree(es)
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()
    with pytest.raises(TypeError, match="no field"):
        fake.set(0, temprature_celsius=90)


class _Recorder:
    """Wraps a FakeNvml and records every attribute NvmlSource reads from its nvml module."""

    def __init__(self, inner: FakeNvml) -> None:
        self._inner = inner
        self.used: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.used.add(name)
        return getattr(self._inner, name)


def test_source_uses_only_names_that_exist_in_pynvml(clock: Clock) -> None:
    fake = FakeNvml(2)
    rec = _Recorder(fake)
    src = NvmlSource(nvml=rec, clock=clock)
    src.open()
    fake.inject_xid(0, 48)
    fake.fail_next["nvmlDeviceGetPowerUsage"] = pynvml.NVMLError_Unknown()
    src.sample()
    fake.lose(1)
    src.sample()
    src.close()
    failing = _Recorder(FakeNvml(1, driver_missing=True))
    with pytest.raises(NvmlUnavailable):
        NvmlSource(nvml=failing).open()
    missing = sorted(n for n in rec.used | failing.used if not hasattr(pynvml, n))
    assert missing == []
    assert {"nvmlInit", "nvmlEventSetWait_v2", "nvmlDeviceGetNvLinkState", "NVMLError_GpuIsLost"} <= rec.used


def test_gpu_trouble_is_logged_once_per_change(
    fake: FakeNvml, source: NvmlSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.nvml")
    fake.lose(2)
    for _ in range(3):
        source.sample()
    assert sum("nvml gpu lost gpu=2" in r.getMessage() for r in caplog.records) == 1
    fake.recover(2)
    source.sample()
    source.sample()
    assert sum("nvml gpu ok gpu=2" in r.getMessage() for r in caplog.records) == 1
