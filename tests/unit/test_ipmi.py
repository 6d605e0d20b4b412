"""agent.ipmi: recorded ipmitool output from several vendors' BMCs, and IpmiSource against a fake
ipmitool (tests/fixtures/ipmi/fake-ipmitool) that hangs, has no BMC, or prints a fixture."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from agent.ipmi import (
    IpmiError,
    IpmiParseError,
    IpmiReading,
    IpmiSource,
    IpmiTimeout,
    IpmiUnavailable,
    parse,
    parse_sdr_elist,
    parse_sensor,
)
from clusterpulse import wire
from clusterpulse.retry import is_transient
from clusterpulse.wire import FanSample, PsuSample

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ipmi"
FAKE = str(FIXTURES / "fake-ipmitool")
ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.txt"))


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def elist_line(name: str, reading: str, *, status: str = "ok", entity: str = "10.1") -> str:
    return f"{name:<16} | 60h | {status:<3} | {entity} | {reading}"


def sensor_line(name: str, value: str, unit: str, status: str) -> str:
    return f"{name:<16} | {value:<10} | {unit:<10} | {status:<6}" + "| na        " * 6


# --- Dell iDRAC: input side only, generic names tied to PSUs by entity 10.N ----------------------


def test_dell_xe9680_six_psus_report_the_input_side_only() -> None:
    r = parse(fixture("dell-xe9680-sdr-elist.txt"))
    amps = [5.2, 5.0, 5.2, 5.4, 5.2, 5.0]
    volts = [230.0, 230.0, 232.0, 232.0, 228.0, 230.0]
    assert r.psus == [
        PsuSample(
            name=f"PS{n}",
            ok=True,
            input_current_amperes=amps[n - 1],
            input_voltage_volts=volts[n - 1],
            status="Presence detected",
        )
        for n in range(1, 7)
    ]
    assert all(p.output_current_amperes is None and p.input_power_watts is None for p in r.psus)
    rpm = [9840, 9480, 9720, 9360, 9840, 9480, 9960, 9600, 9720, 9360, 9840, 9480]
    names = [f"Fan{n}{ab}" for n in range(1, 7) for ab in "AB"]
    assert r.fans == [FanSample(name=n, rpm=float(v), ok=True) for n, v in zip(names, rpm, strict=True)]
    assert (r.format, r.skipped) == ("sdr_elist", 0)


def test_dell_r740xd_ps2_ac_lost_is_a_failed_psu_with_no_readings() -> None:
    r = parse(fixture("dell-r740xd-sdr-elist-ps2-ac-lost.txt"))
    assert r.psus == [
        PsuSample(
            name="PS1",
            ok=True,
            input_current_amperes=1.4,
            input_voltage_volts=232.0,
            status="Presence detected",
        ),
        PsuSample(
            name="PS2",
            ok=False,
            input_current_amperes=None,  # ns "No Reading": None, never 0
            input_voltage_volts=None,
            status="Presence detected, Power Supply AC lost; Current 2: No Reading; Voltage 2: No Reading",
        ),
    ]
    assert [(f.name, f.rpm) for f in r.fans] == [
        ("Fan1A", 5640.0),
        ("Fan2A", 5520.0),
        ("Fan3A", 5640.0),
        ("Fan4A", 5760.0),
        ("Fan5A", 5520.0),
        ("Fan6A", 5640.0),
    ]


# --- HPE iLO: analog + discrete in one reading, a failed supply, Disabled, fans in percent -------


def test_hpe_proliant_failed_supply_disabled_sensor_and_percent_fans() -> None:
    r = parse(fixture("hpe-proliant-dl360-sdr-elist-full.txt"))
    assert r.psus == [
        PsuSample(name="PS1", ok=False, input_power_watts=0.0, status="Presence detected, Failure detected"),
        PsuSample(name="PS2", ok=True, input_power_watts=95.0, status="Presence detected"),
    ]
    # iLO reports fan duty in percent: fans with a status but no RPM; "Fans ... Fully Redundant"
    # is the redundancy sensor, not a fan; "Power Supplies" (10.3) and "Power Meter" are no PSU.
    assert r.fans == [FanSample(name=f"Fan Block {n}", rpm=None, ok=True) for n in range(1, 5)]
    assert (r.format, r.skipped) == ("sdr_elist", 0)


def test_nvidia_dgx1_two_of_four_psus_lost_ac() -> None:
    r = parse(fixture("nvidia-dgx1-sdr-type-power-supply.txt"))
    assert [(p.name, p.ok) for p in r.psus] == [
        ("PSU1", False),
        ("PSU2", False),
        ("PSU3", True),
        ("PSU4", True),
    ]
    assert r.psus[0].status == "Presence detected, Power Supply AC lost"
    assert all(p.input_current_amperes is None for p in r.psus)  # only status sensors here
    assert r.fans == []  # "PSU Alert" / "PSU Redundancy" are neither PSUs nor fans


# --- ipmitool sensor: Supermicro and Intel, discrete bitmasks, na readings ------------------------


def test_supermicro_sensor_ps1_ac_lost_bitmask_and_na_fans() -> None:
    r = parse(fixture("supermicro-x10-sensor-ps1-ac-lost.txt"))
    assert r.psus == [
        PsuSample(name="PS1", ok=False, status="Presence detected, Failure detected, Power Supply AC lost"),
        PsuSample(name="PS2", ok=True, status="Presence detected"),
    ]
    assert r.fans == [
        FanSample(name="FAN1", rpm=4400.0, ok=True),
        FanSample(name="FAN2", rpm=4300.0, ok=True),
        FanSample(name="FAN3", rpm=4400.0, ok=True),
        FanSample(name="FAN4", rpm=None, ok=None),  # na: no fan in that header
        FanSample(name="FAN5", rpm=None, ok=None),
        FanSample(name="FAN6", rpm=None, ok=None),
        FanSample(name="FANA", rpm=4400.0, ok=True),
        FanSample(name="FANB", rpm=None, ok=None),
    ]
    assert (r.format, r.skipped) == ("sensor", 0)


def test_intel_sensor_input_power_and_percent_is_not_a_current() -> None:
    r = parse(fixture("intel-s2600-sensor.txt"))
    assert r.psus == [PsuSample(name="PS1", ok=True, input_power_watts=16.0, status="Presence detected")]
    # "Fan 1 Present", "Fan Redundancy", "PS1 Fan Fail" are not fans; the System Fans read na.
    assert r.fans == [FanSample(name=f"System Fan {n}", rpm=None, ok=None) for n in (1, 2, 3)]


# --- The seed case: PSU2 carries 12 A less than PSU1 ---------------------------------------------

SEED_PSUS = [
    PsuSample(
        name="PSU1",
        ok=True,
        input_power_watts=944.0,
        input_current_amperes=4.1,
        output_current_amperes=73.5,
        input_voltage_volts=230.5,
        output_voltage_volts=12.2,
        status="Presence detected",
    ),
    PsuSample(
        name="PSU2",
        ok=True,
        input_power_watts=792.0,
        input_current_amperes=3.43,
        output_current_amperes=61.5,
        input_voltage_volts=231.0,
        output_voltage_volts=12.1,
        status="Presence detected",
    ),
]


@pytest.mark.parametrize("name", ["psu-imbalance-sdr-elist.txt", "psu-imbalance-sensor.txt"])
def test_seed_case_psu2_output_current_is_12a_below_psu1(name: str) -> None:
    r = parse(fixture(name))
    assert r.psus == SEED_PSUS
    psu1, psu2 = r.psus
    assert psu1.output_current_amperes is not None and psu2.output_current_amperes is not None
    assert psu1.output_current_amperes - psu2.output_current_amperes == pytest.approx(12.0)
    assert [f.name for f in r.fans][-2:] == ["PSU1_Fan", "PSU2_Fan"]  # PSU fans are fans too
    assert [f.rpm for f in r.fans][-2:] == [15800.0, 14200.0]
    assert len(r.fans) == 10


def test_both_formats_of_the_same_node_agree() -> None:
    a = parse_sdr_elist(fixture("psu-imbalance-sdr-elist.txt"))
    b = parse_sensor(fixture("psu-imbalance-sensor.txt"))
    assert (a.psus, a.fans) == (b.psus, b.fans)
    assert (a.format, b.format) == ("sdr_elist", "sensor")


# --- Format detection, skipped lines, unrecognisable text --------------------------------------


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_format_is_detected_and_the_other_parser_refuses(name: str) -> None:
    text = fixture(name)
    expected = "sensor" if "-sensor" in name else "sdr_elist"
    r = parse(text)
    assert r.format == expected
    direct = parse_sensor if expected == "sensor" else parse_sdr_elist
    assert direct(text) == r
    other = parse_sdr_elist if expected == "sensor" else parse_sensor
    with pytest.raises(IpmiParseError):
        other(text)


def test_unparseable_lines_are_skipped_and_counted() -> None:
    clean = fixture("nvidia-dgx1-sdr-type-power-supply.txt")
    lines = clean.splitlines()
    noisy = "\n".join(
        [
            "Unable to send command: Invalid argument",  # ipmitool's chatter, seen in real captures
            *lines[:3],
            "PSU9 Status      | E9h | ok  ",  # truncated
            "",  # blank lines are not counted
            *lines[3:],
            "Unable to send command: Invalid argument",
        ]
    )
    r = parse(noisy)
    assert r.skipped == 3
    assert (r.psus, r.fans) == (parse(clean).psus, parse(clean).fans)

    s = parse("garbage line\n" + fixture("supermicro-x10-sensor-ps1-ac-lost.txt"))
    assert (s.format, s.skipped) == ("sensor", 1)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("\n  \n", "empty"),
        ("hello world\nthis is not ipmitool\n", "expected `ipmitool sdr elist` or `ipmitool sensor`"),
        (
            "Could not open device at /dev/ipmi0 or /dev/ipmi/0 or /dev/ipmidev/0: No such file or directory\n",
            "Could not open device",
        ),
        (
            "PS1 Status       | 0x01              | ok\nPS2 Status       | 0x01              | ok\n",
            "ipmitool sdr list",
        ),
    ],
)
def test_unrecognisable_text_raises_a_parse_error_that_says_why(text: str, says: str) -> None:
    with pytest.raises(IpmiParseError) as info:
        parse(text)
    assert says in str(info.value)
    assert info.value.transient


# --- Status words, ns/na, what is not a PSU's ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "ok"),
    [
        (elist_line("PS1 Status", "Presence detected"), True),
        (elist_line("PS1 Status", "Presence detected, Failure detected"), False),
        (elist_line("PS1 Status", "Presence detected, Predictive failure"), False),
        (elist_line("PS1 Status", "Presence detected, Power Supply AC lost"), False),
        (elist_line("PS1 Status", "Presence detected, AC lost or out-of-range"), False),
        (elist_line("PSU1 Status", "Failure detected", status="cr"), False),
        (elist_line("PS1 Status", ""), None),  # nothing asserted: an empty slot
        (elist_line("PS1 Status", "No Reading", status="ns"), None),
        (elist_line("PS1 Status", "Disabled", status="ns"), None),
        (elist_line("PS1 Output Current", "98.50 Amps", status="cr"), False),
        (elist_line("PS1 Output Current", "98.50 Amps", status="ucr"), False),
        (elist_line("PS1 Input Voltage", "90 Volts", status="lnr"), False),
        (elist_line("PS1 Output Current", "88.00 Amps", status="unc"), True),  # a warning only
        (elist_line("PS1 Output Current", "80.00 Amps"), True),
        (elist_line("PS1 Fan Fail", "State Asserted"), False),
        (elist_line("PS1 Fan Fail", "State Deasserted"), True),
    ],
)
def test_status_words_map_to_ok(line: str, ok: bool | None) -> None:
    (psu,) = parse(line).psus
    assert (psu.name, psu.ok) == ("PS1" if "PS1" in line else "PSU1", ok)


@pytest.mark.parametrize(
    ("state", "ok", "status"),
    [
        ("0x0100", True, "Presence detected"),
        ("0x0180", True, "Presence detected"),  # bit 7 of the second byte is reserved
        ("0x0300", False, "Presence detected, Failure detected"),
        ("0x0500", False, "Presence detected, Predictive failure"),
        ("0x0b00", False, "Presence detected, Failure detected, Power Supply AC lost"),
        ("0x0000", None, "absent (no state asserted)"),
    ],
)
def test_sensor_bitmask_of_a_psu_status(state: str, ok: bool | None, status: str) -> None:
    (psu,) = parse(sensor_line("PS1 Status", "0x1", "discrete", state)).psus
    assert (psu.ok, psu.status) == (ok, status)


def test_ns_and_na_readings_are_none_not_zero() -> None:
    r = parse(
        "\n".join(
            [
                elist_line("PSU1_CIn", "No Reading", status="ns"),
                elist_line("PSU1_COut", "Disabled", status="ns"),
                elist_line("Fan5B", "No Reading", status="ns", entity="7.1"),
            ]
        )
    )
    assert r.psus == [
        PsuSample(name="PSU1", ok=None, status="PSU1_CIn: No Reading; PSU1_COut: Disabled"),
    ]
    assert r.fans == [FanSample(name="Fan5B", rpm=None, ok=None)]

    s = parse(
        "\n".join(
            [
                sensor_line("PSU1_Status", "na", "discrete", "na"),
                sensor_line("PSU1_CIn", "na", "Amps", "na"),
                sensor_line("PSU1_COut", "na", "Amps", "na"),
            ]
        )
    )
    assert s.psus == [
        PsuSample(name="PSU1", ok=None, status="na; PSU1_CIn: na; PSU1_COut: na"),
    ]


def test_system_power_and_redundancy_are_not_a_psu() -> None:
    r = parse(
        "\n".join(
            [
                elist_line("Pwr Consumption", "168 Watts"),  # even on entity 10.1
                elist_line("Power Meter", "100 Watts, Device Enabled", entity="7.6"),
                elist_line("PS Redundancy", "Redundancy Lost", entity="7.1"),
                elist_line("Power Supplies", "Non-Redundant: Sufficient from Redundant", entity="10.3"),
                elist_line("Temp", "45 degrees C", entity="10.1"),
            ]
        )
    )
    assert (r.psus, r.fans) == ([], [])


def test_generic_current_and_voltage_in_sensor_output_use_the_number_in_the_name() -> None:
    r = parse(
        "\n".join(
            [
                sensor_line("Current 1", "0.800", "Amps", "ok"),
                sensor_line("Current 2", "0.200", "Amps", "ok"),
                sensor_line("Voltage 2", "214.000", "Volts", "ok"),
                sensor_line("Status", "0x1", "discrete", "0x0100"),  # no entity: cannot be placed
                sensor_line("Pwr Consumption", "154.000", "Watts", "ok"),
            ]
        )
    )
    assert r.psus == [
        PsuSample(name="PS1", ok=True, input_current_amperes=0.8),
        PsuSample(name="PS2", ok=True, input_current_amperes=0.2, input_voltage_volts=214.0),
    ]


def test_output_power_and_standby_rails_have_no_field_and_are_dropped() -> None:
    r = parse(
        "\n".join(
            [
                elist_line("PSU0_IOUT", "60.00 Amps", entity="10.0"),
                elist_line("PSU0_POUT", "732 Watts", entity="10.0"),
                elist_line("PSU0_STBIOUT", "1.20 Amps", entity="10.0"),
                elist_line("PSU0_STBVOUT", "12.10 Volts", entity="10.0"),
            ]
        )
    )
    assert r.psus == [PsuSample(name="PSU0", ok=True, output_current_amperes=60.0)]


def test_negative_readings_are_dropped_so_the_heartbeat_stays_valid() -> None:
    (psu,) = parse(elist_line("PS1 Input Current", "-0.40 Amps")).psus
    assert psu.input_current_amperes is None
    assert "negative reading -0.4 dropped" in psu.status


def test_duplicate_fan_names_get_unique_labels() -> None:
    r = parse(
        "\n".join(
            [
                elist_line("Fan", "3000 RPM", entity="7.1"),
                elist_line("Fan", "3100 RPM", entity="7.2"),
            ]
        )
    )
    assert [f.name for f in r.fans] == ["Fan", "Fan #2"]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_makes_a_heartbeat_the_orchestrator_accepts(name: str) -> None:
    r = parse(fixture(name))
    hb = wire.Heartbeat(
        v=wire.PROTOCOL_VERSION,
        node="gpu-node-1",
        boot_id="b1",
        seq=1,
        sent_at=0.0,
        interval_s=30.0,
        gpu_source="none",
        ipmi="ok",
        psus=tuple(r.psus),
        fans=tuple(r.fans),
    )
    back = wire.decode_heartbeat(wire.encode(hb))
    assert (back.psus, back.fans) == (tuple(r.psus), tuple(r.fans))


def test_reading_is_frozen() -> None:
    r = IpmiReading(psus=[], fans=[])
    with pytest.raises(AttributeError):
        r.skipped = 1  # type: ignore[misc]


# --- Errors --------------------------------------------------------------------------------------


def test_error_kinds_are_transient_or_permanent() -> None:
    assert issubclass(IpmiError, Exception)
    assert IpmiTimeout("t").transient and is_transient(IpmiTimeout("t"))
    assert IpmiParseError("p").transient
    assert not IpmiUnavailable("u").transient and not is_transient(IpmiUnavailable("u"))
    for cls in (IpmiTimeout, IpmiUnavailable, IpmiParseError):
        assert issubclass(cls, IpmiError)


# --- IpmiSource against the fake ipmitool ---------------------------------------------------------


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: no /proc entry, or a zombie left for init to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_until(condition: object, timeout_s: float = 5.0) -> bool:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def test_source_interface() -> None:
    src = IpmiSource()
    assert src.name == "ipmi"
    assert src.argv == ("ipmitool", "sdr", "elist")
    assert src.timeout_s == 10.0
    with pytest.raises(ValueError, match="command"):
        IpmiSource(command="")
    with pytest.raises(ValueError, match="timeout_s"):
        IpmiSource(timeout_s=0)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["sdr", "elist"], "dell-xe9680-sdr-elist.txt"),
        (["-I", "open", "sdr", "elist", "full"], "hpe-proliant-dl360-sdr-elist-full.txt"),
        (["sensor"], "supermicro-x10-sensor-ps1-ac-lost.txt"),
        (["sensor", "list"], "psu-imbalance-sensor.txt"),
    ],
)
def test_source_reads_and_parses_the_fake(monkeypatch: pytest.MonkeyPatch, args: list[str], name: str) -> None:
    monkeypatch.setenv("FAKE_IPMI_FIXTURE", str(FIXTURES / name))
    reading = asyncio.run(IpmiSource(command=[FAKE, *args], timeout_s=10).read())
    assert reading == parse(fixture(name))


def test_source_splits_a_string_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_IPMI_FIXTURE", str(FIXTURES / "psu-imbalance-sdr-elist.txt"))
    src = IpmiSource(command=f"'{FAKE}' -I open sdr elist")
    assert src.argv == (FAKE, "-I", "open", "sdr", "elist")
    assert asyncio.run(src.read()).psus == SEED_PSUS


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see processes")
def test_source_timeout_kills_the_process_group_and_reaps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("FAKE_IPMI_HANG", "1")
    monkeypatch.setenv("FAKE_IPMI_PIDFILE", str(pidfile))
    # 2 s: the fake (a Python script) must start, start its child and write both pids before it is
    # killed; under three test workers on two cores 0.5 s was not always enough to get that far
    src = IpmiSource(command=[FAKE, "sdr", "elist"], timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(IpmiTimeout, match=r"did not finish within 2s") as info:
        asyncio.run(src.read())
    assert time.monotonic() - started < 5.0
    assert info.value.transient
    leader, child = (int(p) for p in pidfile.read_text().split())
    assert not Path(f"/proc/{leader}").exists()  # killed and reaped by us: no zombie
    assert _wait_until(lambda: _gone(child))  # the grandchild died with its group


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see processes")
def test_cancelling_a_read_leaves_no_process_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("FAKE_IPMI_HANG", "1")
    monkeypatch.setenv("FAKE_IPMI_PIDFILE", str(pidfile))

    async def scenario() -> None:
        task = asyncio.create_task(IpmiSource(command=[FAKE, "sensor"], timeout_s=60).read())
        deadline = time.monotonic() + 10
        while not pidfile.exists():
            assert time.monotonic() < deadline, "the fake never started"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    leader, child = (int(p) for p in pidfile.read_text().split())
    assert not Path(f"/proc/{leader}").exists()
    assert _wait_until(lambda: _gone(child))


def test_source_without_a_bmc_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_IPMI_NO_BMC", "1")
    with pytest.raises(IpmiUnavailable) as info:
        asyncio.run(IpmiSource(command=[FAKE, "sdr", "elist"]).read())
    msg = str(info.value)
    assert "Could not open device at /dev/ipmi0" in msg
    assert "ipmi_si" in msg and "exit status 1" in msg
    assert not info.value.transient


def test_source_without_a_lan_session_is_unavailable_and_hides_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_IPMI_NO_BMC", "1")
    cmd = [FAKE, "-I", "lanplus", "-H", "10.0.0.9", "-U", "admin", "-P", "s3cret-pw", "sdr", "elist"]
    with pytest.raises(IpmiUnavailable) as info:
        asyncio.run(IpmiSource(command=cmd).read())
    msg = str(info.value)
    assert "Unable to establish IPMI v2 / RMCP+ session" in msg
    assert "s3cret-pw" not in msg and "-P '****'" in msg
    assert "s3cret-pw" not in repr(IpmiSource(command=cmd))


def test_source_with_a_missing_binary_is_unavailable() -> None:
    with pytest.raises(IpmiUnavailable, match=r"'/nonexistent/bin/ipmitool' not found") as info:
        asyncio.run(IpmiSource(command=["/nonexistent/bin/ipmitool", "sdr", "elist"]).read())
    assert not info.value.transient


def test_source_with_a_failing_command_is_unavailable() -> None:
    with pytest.raises(IpmiUnavailable, match=r"failed \(exit status 1\): Invalid command: chassis status"):
        asyncio.run(IpmiSource(command=[FAKE, "chassis", "status"]).read())


def test_source_with_unparseable_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    junk = tmp_path / "junk.txt"
    junk.write_text("the BMC is resetting, try later\n")
    monkeypatch.setenv("FAKE_IPMI_FIXTURE", str(junk))
    with pytest.raises(IpmiParseError) as info:
        asyncio.run(IpmiSource(command=[FAKE, "sdr", "elist"]).read())
    assert info.value.transient

    sdr_list = tmp_path / "sdr-list.txt"  # `sdr list` instead of `sdr elist`: a wrong command
    sdr_list.write_text("PS1 Status       | 0x01              | ok\nFan1             | 3000 RPM          | ok\n")
    monkeypatch.setenv("FAKE_IPMI_FIXTURE", str(sdr_list))
    with pytest.raises(IpmiUnavailable, match="sdr elist"):
        asyncio.run(IpmiSource(command=[FAKE, "sdr", "elist"]).read())


@pytest.mark.skipif(
    shutil.which("ipmitool") is None or Path("/dev/ipmi0").exists(),
    reason="needs the real ipmitool on a machine without a BMC device",
)
def test_real_ipmitool_without_a_bmc_is_unavailable() -> None:
    with pytest.raises(IpmiUnavailable, match="Could not open device"):
        asyncio.run(IpmiSource(timeout_s=10).read())
