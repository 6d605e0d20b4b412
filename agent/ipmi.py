"""Power supplies and fans from the BMC: parse ``ipmitool`` output, run it under a timeout.

:func:`parse` reads ``ipmitool sdr elist`` (the default; it carries the entity, ``10.N`` is PSU
N) and ``ipmitool sensor`` (discrete states as a bitmask), telling them apart by their columns.
What the caller may assume:

* a sensor belongs to PSU *n* when its name carries the number, or (``sdr elist``) its entity
  is ``10.N``; PSU names keep the vendor's numbering;
* Amps, Volts and Watts are the input side unless the name says output; output power, standby
  rails, percentages and temperatures are dropped, PSU fans become fans;
* a PSU's ``ok`` is ``False`` on any critical reading or asserted failure, ``True`` when present
  and healthy, ``None`` when nothing says (an empty slot); ``status`` says it in words;
* a reading the BMC does not have is ``None``, never zero; negative readings are dropped;
* a line that fits neither layout is skipped and counted (:attr:`IpmiReading.skipped`); only
  text with no sensor line at all raises :class:`IpmiParseError`.

Every rule, with the vendors' spellings: docs/design/ipmi.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from clusterpulse.retry import PulseError
from clusterpulse.wire import FanSample, PsuSample

log = logging.getLogger("pulse.agent.ipmi")

Format = Literal["sdr_elist", "sensor"]


# --- Errors ------------------------------------------------------------------------------------


class IpmiError(PulseError):
    """Root of this module's errors; ``transient`` says whether trying again later may help."""

    transient: bool = False


class IpmiTimeout(IpmiError):
    """ipmitool did not finish in time (a slow or wedged BMC); it was killed. Try again later."""

    transient = True


class IpmiUnavailable(IpmiError):
    """No BMC can be read with this command on this node: ipmitool is missing, the IPMI device or
    session cannot be opened, or ipmitool failed. Retrying will not help; the message says why."""

    transient = False


class IpmiParseError(IpmiError):
    """The text holds no sensor line of either format. Transient: a BMC that is resetting can
    answer with nothing useful once; a wrong command is reported as :class:`IpmiUnavailable`."""

    transient = True


# --- The reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpmiReading:
    """PSUs (sorted by number) and fans (in BMC order) from one ipmitool run.

    ``skipped`` counts non-empty lines that fit neither format; ``format`` is the one detected.
    """

    psus: list[PsuSample]
    fans: list[FanSample]
    skipped: int = 0
    format: Format = "sdr_elist"


@dataclass(frozen=True)
class _Sensor:
    """One sensor line, normalised across both formats."""

    name: str
    state: str  # the status column, lower case: ok, nc, cr, ns, na, lcr, ... or a sensor bitmask
    entity: tuple[int, int] | None  # sdr elist only
    value: float | None
    unit: str  # lower case: amps, volts, watts, rpm, percent, degrees c, discrete, ""
    events: tuple[str, ...]  # asserted states in words ("Presence detected", ...)
    no_reading: str = ""  # "No Reading", "Disabled", "na" when the BMC has no value


_ELIST_ID = re.compile(r"[0-9A-Fa-f]{2}h")
_ENTITY = re.compile(r"(\d+)\.(\d+)")
_STATES = frozenset({"ok", "nc", "cr", "nr", "ns", "na", "lnc", "unc", "lcr", "ucr", "lnr", "unr"})
_CRITICAL = frozenset({"cr", "nr", "lcr", "ucr", "lnr", "unr"})
_WARNING = frozenset({"nc", "lnc", "unc"})
_SENSOR_VALUE = re.compile(r"-?\d+(?:\.\d+)?|0x[0-9A-Fa-f]+|na")
_BITMASK = re.compile(r"0x([0-9A-Fa-f]{2})([0-9A-Fa-f]{2})")
_NUMBER_UNIT = re.compile(r"(-?\d+(?:\.\d+)?)\s+([A-Za-z%].*)")
_HEX = re.compile(r"0x[0-9A-Fa-f]+")
_NO_READING = frozenset({"no reading", "disabled", "not readable", "unavailable", "na", "n/a"})

# Sensor-specific offsets of IPMI sensor type 0x08 (Power Supply), in ipmitool's own words.
_PSU_OFFSETS = (
    "Presence detected",
    "Failure detected",
    "Predictive failure",
    "Power Supply AC lost",
    "AC lost or out-of-range",
    "AC out-of-range, but present",
    "Config Error",
)

_PSU_NAME = re.compile(r"\s*(PSU|PS|Power\s*Supply)\s*[_\- ]?\s*(\d+)(?!\d)(.*)", re.IGNORECASE)
_DELL_GENERIC = re.compile(r"(status|current\s*(\d+)|voltage\s*(\d+))", re.IGNORECASE)
_POWER_SUPPLY_ENTITY = 10
_FAILURE_WORDS = re.compile(r"fail|ac lost|input lost|out[- ]of[- ]range|config(uration)? error|fault", re.IGNORECASE)
_PRESENCE_WORDS = re.compile(r"presence detected|device present|^present$", re.IGNORECASE)
_ABSENT_WORDS = re.compile(r"absent|not present|device removed", re.IGNORECASE)
_FAIL_NAME = re.compile(r"fail|fault", re.IGNORECASE)
_FAN_NAME = re.compile(r"fan", re.IGNORECASE)
_NOT_A_FAN = re.compile(r"redundan|present|presence|status|fail|fault|pwm|duty|%", re.IGNORECASE)
_STANDBY_RAIL = re.compile(r"stb|standby|\bsb\b|12vsb|vsb", re.IGNORECASE)
_STATUS_MAX = 256


def parse(text: str) -> IpmiReading:
    """Parse the output of ``ipmitool sdr elist`` or ``ipmitool sensor``, whichever it is."""
    lines = text.splitlines()
    elist = sum(1 for line in lines if _elist_sensor(line) is not None)
    sensor = sum(1 for line in lines if _sensor_sensor(line) is not None)
    if elist == 0 and sensor == 0:
        raise IpmiParseError(_unrecognised(text))
    return parse_sdr_elist(text) if elist >= sensor else parse_sensor(text)


def parse_sdr_elist(text: str) -> IpmiReading:
    """Parse ``ipmitool sdr elist`` output (also ``sdr elist full`` and ``sdr type ...``)."""
    return _parse(text, "sdr_elist")


def parse_sensor(text: str) -> IpmiReading:
    """Parse ``ipmitool sensor`` (``sensor list``) output."""
    return _parse(text, "sensor")


def _parse(text: str, fmt: Format) -> IpmiReading:
    read_line = _elist_sensor if fmt == "sdr_elist" else _sensor_sensor
    sensors: list[_Sensor] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        s = read_line(line)
        if s is None:
            skipped += 1
        else:
            sensors.append(s)
    if not sensors:
        what = "ipmitool sdr elist" if fmt == "sdr_elist" else "ipmitool sensor"
        raise IpmiParseError(f"no {what} line in the output: {_unrecognised(text)}")
    psus, fans = _assemble(sensors)
    return IpmiReading(psus=psus, fans=fans, skipped=skipped, format=fmt)


def _looks_like_sdr_list(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and sum(1 for line in lines if line.count("|") == 2) > len(lines) // 2


def _unrecognised(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return "the output is empty"
    if _looks_like_sdr_list(text):
        return (
            "this looks like `ipmitool sdr list` (name | reading | status), which carries no entity "
            "IDs; run `ipmitool sdr elist` or `ipmitool sensor` instead"
        )
    first = lines[0].strip()
    return f"expected `ipmitool sdr elist` or `ipmitool sensor` output, got {first[:120]!r}"


# --- Line readers ------------------------------------------------------------------------------


def _elist_sensor(line: str) -> _Sensor | None:
    parts = [p.strip() for p in line.split("|")]
    if len(parts) != 5 or not parts[0] or not _ELIST_ID.fullmatch(parts[1]):
        return None
    state = parts[2].lower()
    entity = _ENTITY.fullmatch(parts[3])
    if state not in _STATES or entity is None:
        return None
    value: float | None = None
    unit = ""
    items = [p.strip() for p in parts[4].split(",") if p.strip()]
    no_reading = ""
    if len(items) == 1 and items[0].lower() in _NO_READING:
        no_reading, items = items[0], []
    elif items and not _HEX.fullmatch(items[0]):
        m = _NUMBER_UNIT.fullmatch(items[0])
        if m is not None:
            value, unit, items = float(m.group(1)), m.group(2).strip().lower(), items[1:]
    if state in {"ns", "na"} and value is None and not no_reading:
        no_reading = "No Reading"
    return _Sensor(
        name=parts[0],
        state=state,
        entity=(int(entity.group(1)), int(entity.group(2))),
        value=value,
        unit=unit,
        events=tuple(items),
        no_reading=no_reading,
    )


def _sensor_sensor(line: str) -> _Sensor | None:
    parts = [p.strip() for p in line.split("|")]
    if len(parts) < 4 or not parts[0]:
        return None
    raw, unit, state = parts[1], parts[2].lower(), parts[3].lower()
    if not _SENSOR_VALUE.fullmatch(raw) or not (state in _STATES or _BITMASK.fullmatch(state)):
        return None
    value: float | None = None
    no_reading = ""
    if raw == "na":
        no_reading = "na"
    elif not raw.startswith("0x") and unit != "discrete":
        value = float(raw)
    return _Sensor(name=parts[0], state=state, entity=None, value=value, unit=unit, events=(), no_reading=no_reading)


# --- From sensors to PSUs and fans ---------------------------------------------------------------


@dataclass
class _PsuBuild:
    number: int
    name: str
    values: dict[str, float] = field(default_factory=dict)
    verdicts: list[bool | None] = field(default_factory=list)  # from thresholds and assertions
    status_verdicts: list[bool | None] = field(default_factory=list)  # from its status sensor(s)
    status_notes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def status(self, verdict: bool | None, note: str) -> None:
        self.status_verdicts.append(verdict)
        self.status_notes.append(note)

    def sample(self) -> PsuSample:
        if any(v is False for v in self.verdicts + self.status_verdicts):
            ok: bool | None = False
        elif self.status_verdicts:
            ok = True if any(self.status_verdicts) else None
        else:
            ok = True if any(self.verdicts) else None
        status = "; ".join(dict.fromkeys(n for n in self.status_notes + self.notes if n))
        if len(status) > _STATUS_MAX:
            status = status[: _STATUS_MAX - 3] + "..."
        return PsuSample(
            name=self.name,
            ok=ok,
            input_power_watts=self.values.get("input_power_watts"),
            input_current_amperes=self.values.get("input_current_amperes"),
            output_current_amperes=self.values.get("output_current_amperes"),
            input_voltage_volts=self.values.get("input_voltage_volts"),
            output_voltage_volts=self.values.get("output_voltage_volts"),
            status=status,
        )


def _assemble(sensors: Iterable[_Sensor]) -> tuple[list[PsuSample], list[FanSample]]:
    psus: dict[int, _PsuBuild] = {}
    fans: list[FanSample] = []
    fan_names: set[str] = set()
    for s in sensors:
        placed = _psu_of(s)
        if placed is not None:
            number, prefix, rest = placed
            build = psus.setdefault(number, _PsuBuild(number=number, name=f"{prefix}{number}"))
            _apply(build, s, rest)
        if _is_fan(s):
            name, n = s.name, 2
            while name in fan_names:  # fan labels must be unique per node
                name, n = f"{s.name} #{n}", n + 1
            fan_names.add(name)
            rpm = s.value if s.unit == "rpm" and s.value is not None and s.value >= 0 else None
            fans.append(FanSample(name=name, rpm=rpm, ok=_state_verdict(s.state)))
    return [psus[n].sample() for n in sorted(psus)], fans


def _psu_of(s: _Sensor) -> tuple[int, str, str] | None:
    """(PSU number, name prefix, the rest of the sensor name in lower case), or None."""
    m = _PSU_NAME.fullmatch(s.name)
    if m is not None:
        prefix = "PSU" if m.group(1).upper() == "PSU" else "PS"
        return int(m.group(2)), prefix, m.group(3).strip(" _-").lower()
    g = _DELL_GENERIC.fullmatch(s.name.strip())
    if g is None:
        return None
    if s.entity is not None:  # sdr elist: the entity says which PSU
        if s.entity[0] != _POWER_SUPPLY_ENTITY:
            return None
        return s.entity[1], "PS", s.name.lower()
    number = g.group(2) or g.group(3)  # ipmitool sensor: only the name can say which PSU
    return (int(number), "PS", s.name.lower()) if number is not None else None


def _apply(build: _PsuBuild, s: _Sensor, rest: str) -> None:
    """Fold one sensor into its PSU: a reading into a field, its state into the verdicts."""
    status_like = rest == "" or "status" in rest or "supply" in rest
    bitmask = _BITMASK.fullmatch(s.state)
    if bitmask is not None:  # ipmitool sensor, discrete: decode the power-supply offsets
        if status_like:
            events = _decode_psu_bitmask(int(bitmask.group(1), 16))
            build.status(_events_verdict(events), ", ".join(events) or "absent (no state asserted)")
        return
    if s.no_reading:  # ns, na, No Reading, Disabled: nothing to read, nothing to judge
        if status_like:
            build.status(None, s.no_reading)
        else:
            build.notes.append(f"{s.name}: {s.no_reading}")
        return

    fieldname = _psu_field(s.unit, rest)
    if fieldname is not None and s.value is not None:
        if s.value < 0:
            build.notes.append(f"{s.name}: negative reading {s.value:g} dropped")
        else:
            build.values.setdefault(fieldname, s.value)

    if s.events:
        if status_like or any(_PRESENCE_WORDS.search(e) for e in s.events):
            build.status(_events_verdict(s.events), ", ".join(s.events))
        else:
            asserted = _asserted(s.events)
            if asserted is not None and _FAIL_NAME.search(rest):
                build.verdicts.append(not asserted)
                if asserted:
                    build.notes.append(f"{s.name}: {', '.join(s.events)}")
    elif s.value is None and status_like and s.unit != "discrete":
        build.status(None, "absent (no state asserted)")  # an sdr elist status asserting nothing

    if s.value is not None:
        build.verdicts.append(_state_verdict(s.state))
    elif s.state in _CRITICAL:
        build.verdicts.append(False)
    if s.state in _CRITICAL or s.state in _WARNING:
        build.notes.append(f"{s.name}: {s.state}")


def _psu_field(unit: str, rest: str) -> str | None:
    if _STANDBY_RAIL.search(rest):
        return None
    out = "out" in rest
    if unit == "amps":
        return "output_current_amperes" if out else "input_current_amperes"
    if unit == "volts":
        return "output_voltage_volts" if out else "input_voltage_volts"
    if unit == "watts":
        return None if out else "input_power_watts"
    return None


def _decode_psu_bitmask(data2: int) -> tuple[str, ...]:
    return tuple(word for bit, word in enumerate(_PSU_OFFSETS) if data2 & (1 << bit))


def _events_verdict(events: Sequence[str]) -> bool | None:
    """Verdict of a power-supply status: a failure wins over presence; nothing asserted is None."""
    if any(_FAILURE_WORDS.search(e) for e in events) and _asserted(events) is not False:
        return False
    if any(_PRESENCE_WORDS.search(e) for e in events):
        return True
    if any(_ABSENT_WORDS.search(e) for e in events):
        return None
    asserted = _asserted(events)
    return None if asserted is None else not asserted


def _asserted(events: Sequence[str]) -> bool | None:
    """For generic digital sensors: True for ``State Asserted``, False for ``State Deasserted``."""
    text = ", ".join(events).lower()
    if "state deasserted" in text:
        return False
    if "state asserted" in text:
        return True
    return None


def _state_verdict(state: str) -> bool | None:
    if state == "ok" or state in _WARNING:
        return True
    if state in _CRITICAL:
        return False
    return None


def _is_fan(s: _Sensor) -> bool:
    """An RPM reading, or a fan-named sensor with a percentage (HPE) or no reading at all."""
    if s.unit == "rpm":
        return True
    if not _FAN_NAME.search(s.name) or _NOT_A_FAN.search(s.name):
        return False
    if any("redundan" in e.lower() for e in s.events):
        return False
    return s.unit == "percent" or (s.unit == "" and s.value is None)


# --- Running ipmitool --------------------------------------------------------------------------

_SECRET_OPTIONS = frozenset({"-P", "-k", "-y"})
_REAP_GRACE_S = 5.0


class IpmiSource:
    """Reads PSUs and fans by running ipmitool (``sdr elist`` by default) under a timeout.

    ``read()`` raises :class:`IpmiTimeout` (transient) when the command runs past ``timeout_s``
    (the whole process group is killed and reaped first), :class:`IpmiUnavailable` (permanent)
    when ipmitool is missing, cannot open the BMC or exits non-zero, and :class:`IpmiParseError`
    (transient) when its output holds no sensor line. Passwords given with ``-P``/``-k``/``-y``
    never appear in messages.
    """

    name = "ipmi"

    def __init__(self, *, command: Sequence[str] | str = "ipmitool sdr elist", timeout_s: float = 10.0) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("command: expected ipmitool and its arguments, got nothing")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.argv: tuple[str, ...] = tuple(argv)
        self.timeout_s = float(timeout_s)

    def __repr__(self) -> str:
        return f"IpmiSource(command={_display(self.argv)!r}, timeout_s={self.timeout_s})"

    async def read(self) -> IpmiReading:
        stdout, stderr, rc = await self._run()
        out = stdout.decode("utf-8", errors="replace")
        err = stderr.decode("utf-8", errors="replace")
        if rc != 0:
            raise IpmiUnavailable(_explain_failure(self.argv, rc, err, out))
        try:
            return parse(out)
        except IpmiParseError as exc:
            if _looks_like_sdr_list(out):  # a wrong command: trying again will not help
                raise IpmiUnavailable(f"{_display(self.argv)}: {exc}") from None
            raise IpmiParseError(f"{_display(self.argv)}: {exc}") from None

    async def _run(self) -> tuple[bytes, bytes, int]:
        cmd = _display(self.argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, so a timeout can kill all of it
            )
        except FileNotFoundError:
            raise IpmiUnavailable(
                f"{self.argv[0]!r} not found (install ipmitool, or point the IPMI command at it)"
            ) from None
        except PermissionError as exc:
            raise IpmiUnavailable(f"{self.argv[0]!r} cannot be executed: {exc.strerror}") from None
        except OSError as exc:
            raise IpmiUnavailable(f"{cmd} could not be started: {exc}") from None
        try:
            async with asyncio.timeout(self.timeout_s):
                stdout, stderr = await proc.communicate()
        except TimeoutError:
            await _kill_and_reap(proc)
            raise IpmiTimeout(
                f"{cmd} did not finish within {self.timeout_s:g}s and was killed (a slow or hung BMC)"
            ) from None
        finally:
            if proc.returncode is None:  # cancelled from outside: leave nothing behind
                await _kill_and_reap(proc)
        assert proc.returncode is not None
        return stdout, stderr, proc.returncode


async def _kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group led by ``proc`` and wait for ``proc`` so no zombie is left."""
    with contextlib.suppress(ProcessLookupError):  # ProcessLookupError: the group is already gone
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except PermissionError:  # e.g. a sudo'ed ipmitool: kill what we may, the child itself
            log.warning("event=ipmi_kill_denied pid=%d fallback=kill_child", proc.pid)
            with contextlib.suppress(PermissionError):
                proc.kill()
    try:
        async with asyncio.timeout(_REAP_GRACE_S):
            await proc.wait()
    except TimeoutError:
        log.warning("event=ipmi_reap_timeout pid=%d grace_s=%.0f", proc.pid, _REAP_GRACE_S)


def _display(argv: Sequence[str]) -> str:
    shown: list[str] = []
    hide = False
    for arg in argv:
        shown.append("****" if hide else arg)
        hide = arg in _SECRET_OPTIONS
    return shlex.join(shown)


def _explain_failure(argv: Sequence[str], rc: int, stderr: str, stdout: str) -> str:
    cmd = _display(argv)
    lines = [line.strip() for line in (stderr or stdout).splitlines() if line.strip()]
    said = " / ".join(lines[-3:])[:300] or "no output"
    how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
    low = said.lower()
    if "could not open device" in low:
        return (
            f"{cmd} cannot open the local IPMI device ({how}): {said}. No BMC driver on this node: "
            "load ipmi_si and ipmi_devintf and run as root, or reach the BMC over the network with "
            "-I lanplus -H <bmc>"
        )
    if "rmcp+" in low or "unable to establish" in low or "rakp" in low or "invalid user name" in low:
        return (
            f"{cmd} cannot open a session with the BMC ({how}): {said}. Check the -H address, the "
            "user and password, and that IPMI over LAN is enabled on the BMC"
        )
    if "permission denied" in low:
        return f"{cmd} was refused access ({how}): {said}. Run the agent as root or grant access to /dev/ipmi0"
    return f"{cmd} failed ({how}): {said}"
