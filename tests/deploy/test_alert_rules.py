"""Alerting and recording rules: promtool, SPEC names, metadata, runbooks and unit-test coverage."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from deploy_files import (
    ALERT_SCOPES,
    ALERTS_FILE,
    DASHBOARDS,
    LOW_MFU_EXPR,
    LOW_MFU_FOR,
    PER_NODE_HEARTBEAT_ALERTS,
    PROMETHEUS,
    PROMTOOL_TESTS,
    RECORDING_FILE,
    RECORDING_NAME,
    RECORDING_REF,
    RUNBOOK_BASE,
    RUNBOOKS,
    SPEC_ALERTS,
    alert_rules,
    fatal_xids,
    load_json,
    load_yaml,
    recording_rules,
    run_tool,
    settings_defaults,
    tool_output,
)

SEVERITIES = {"critical", "warning", "info"}


def rules_named(name: str) -> list[dict[str, Any]]:
    found = [rule for rule in alert_rules() if rule["alert"] == name]
    assert found, f"alert {name} is not defined in {ALERTS_FILE.name}"
    return found


def squash(expr: str) -> str:
    return " ".join(expr.split())


# ---- promtool


def test_promtool_check_rules(promtool: str) -> None:
    proc = run_tool(promtool, "check", "rules", ALERTS_FILE, RECORDING_FILE)
    assert proc.returncode == 0, tool_output(proc)


def test_promtool_test_files_exist() -> None:
    assert PROMTOOL_TESTS, f"no promtool unit tests in {PROMETHEUS / 'tests'}"


@pytest.mark.parametrize("test_file", PROMTOOL_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(promtool: str, test_file: Path) -> None:
    proc = run_tool(promtool, "test", "rules", test_file.name, cwd=test_file.parent)
    assert proc.returncode == 0, tool_output(proc)


@pytest.mark.parametrize("test_file", PROMTOOL_TESTS, ids=lambda p: p.name)
def test_unit_tests_load_both_rule_files(test_file: Path) -> None:
    loaded = {(test_file.parent / f).resolve() for f in load_yaml(test_file)["rule_files"]}
    assert {ALERTS_FILE.resolve(), RECORDING_FILE.resolve()} <= loaded, (
        f"{test_file.name} must load alerts.yml and recording.yml (alerts read recording rules)"
    )


# ---- names and metadata


def test_every_spec_alert_is_defined() -> None:
    defined = {rule["alert"] for rule in alert_rules()}
    missing = sorted(set(SPEC_ALERTS) - defined)
    assert not missing, f"SPEC alerts missing from {ALERTS_FILE.name}: {missing}"


def test_every_alert_is_held_to_the_rules() -> None:
    """An alert of our own is in OWN_ALERTS (deploy_files.py), so the tests below cover it too."""
    defined = {rule["alert"] for rule in alert_rules()}
    assert not defined - set(ALERT_SCOPES), f"alerts with no scope: {sorted(defined - set(ALERT_SCOPES))}"


@pytest.mark.parametrize("name", sorted(ALERT_SCOPES))
def test_alert_metadata(name: str) -> None:
    scope = ALERT_SCOPES[name]
    for rule in rules_named(name):
        labels = rule.get("labels", {})
        annotations = rule.get("annotations", {})
        assert labels.get("severity") in SEVERITIES, f"{name}: severity {labels.get('severity')!r}"
        for key in ("summary", "description", "runbook_url"):
            assert str(annotations.get(key, "")).strip(), f"{name}: annotation {key} is missing or empty"
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{name}.md", f"{name}: runbook_url"
        named = {
            "node": ["node"],
            "gpu": ["node", "gpu"],
            "port": ["node", "device", "port"],
            "job": ["job"],
            "cluster": [],
        }[scope]
        for label in named:
            for key in ("summary", "description"):
                assert re.search(rf"\$labels\.{label}\b", annotations[key]), (
                    f"{name}: the {key} must name the {label} ({{{{ $labels.{label} }}}})"
                )


def test_every_alert_name_has_one_severity_per_rule_set() -> None:
    """Several rules may share a name (GPUXidError), but each must differ by severity."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for rule in alert_rules():
        by_name[rule["alert"]].append(rule["labels"]["severity"])
    for name, severities in by_name.items():
        assert len(severities) == len(set(severities)), f"{name}: duplicate rules {severities}"


def test_low_mfu_is_exactly_as_spec() -> None:
    (rule,) = rules_named("LowMFU")
    assert str(rule["expr"]).strip() == LOW_MFU_EXPR
    assert rule["for"] == LOW_MFU_FOR
    assert rule["labels"]["severity"] == "critical"


@pytest.mark.parametrize("name", PER_NODE_HEARTBEAT_ALERTS)
def test_per_node_heartbeat_alerts_hold_during_partition(name: str) -> None:
    for rule in rules_named(name):
        assert re.search(
            r"unless\s+on\s*\(\s*\)\s*\(?\s*pulse_partition_suspected\s*==\s*1\s*\)?\s*$",
            str(rule["expr"]).strip(),
        ), f"{name} must end with `unless on () pulse_partition_suspected == 1`: {rule['expr']}"


def test_orchestrator_down_uses_the_scrape_job() -> None:
    (rule,) = rules_named("OrchestratorDown")
    expr = squash(rule["expr"])
    assert 'up{job="clusterpulse-orchestrator"} == 0' in expr
    assert 'absent(up{job="clusterpulse-orchestrator"})' in expr


def test_xid_rules_mirror_the_wire_contract() -> None:
    """The fatal-XID regex in the rules is clusterpulse.wire.FATAL_XIDS, for both rules."""
    by_severity = {rule["labels"]["severity"]: squash(rule["expr"]) for rule in rules_named("GPUXidError")}
    assert set(by_severity) == {"critical", "warning"}
    for severity, op in (("critical", "=~"), ("warning", "!~")):
        regexes = set(re.findall(rf'xid{op}"([0-9|]+)"', by_severity[severity]))
        assert len(regexes) == 1, f"{severity} rule: one xid{op} regex expected, got {regexes}"
        assert {int(x) for x in regexes.pop().split("|")} == fatal_xids()


def test_thresholds_follow_the_orchestrator_defaults() -> None:
    """alerts.yml repeats some health-policy defaults; they must not drift apart."""
    defaults = settings_defaults()
    (temp,) = rules_named("GPUTemperatureHigh")
    assert re.search(rf">\s*{defaults['gpu_temperature_warn_celsius']:g}\b", temp["expr"])
    (psu,) = rules_named("PSUCurrentImbalance")
    expr = squash(psu["expr"])
    assert f'{{side="output"}} > {defaults["psu_output_imbalance_amperes"]:g}' in expr
    assert f'{{side="input"}} > {defaults["psu_input_imbalance_amperes"]:g}' in expr
    (power,) = rules_named("GPUPowerBelowPeers")
    factor = 1 - float(defaults["gpu_power_peer_gap_ratio"])  # type: ignore[arg-type]
    assert f"{factor:g} * node:pulse_gpu_power_watts:p75" in squash(power["expr"])


def test_nic_thresholds_follow_the_orchestrator_defaults() -> None:
    """The port rules repeat the health model's NIC thresholds (services/health/nics.py)."""
    defaults = settings_defaults()
    by_severity = {rule["labels"]["severity"]: squash(rule["expr"]) for rule in rules_named("NICErrorsRising")}
    faults = by_severity["warning"]
    for counter in ("link_downed", "excessive_buffer_overrun_errors", "local_link_integrity_errors"):
        assert re.search(rf'counter=~"[a-z_|]*\b{counter}\b[a-z_|]*"\}}\[1h\]\) > 0', faults), counter
    assert f'counter="symbol_error"}}[1h]) > {defaults["nic_symbol_error_fatal_per_hour"]:g}' in faults
    recovery = f'counter="link_error_recovery"}}[5m]) * 60 > {defaults["nic_link_error_recovery_per_min"]:g}'
    assert recovery in faults
    assert f'counter="port_rcv_errors"}}[5m]) > {defaults["nic_port_rcv_errors_per_s"]:g}' in faults
    discards = f'counter="port_xmit_discards"}}[5m]) > {defaults["nic_port_xmit_discards_per_s"]:g}'
    assert discards in by_severity["info"]
    (tcp,) = rules_named("NCCLOverTCP")
    threshold = re.search(r'direction="tx"\}\[2m\]\)\) > ([\d.e]+)', squash(tcp["expr"]))
    assert threshold, tcp["expr"]
    assert float(threshold[1]) == defaults["nic_tcp_bytes_per_s"]


def test_power_below_peers_compares_with_the_upper_quartile() -> None:
    """As services/health/decide.py does: the node's 0.75 quantile, only on a loaded node of 3+ GPUs.

    Not the median: when one PSU sags, half the GPUs of a board drop together (700 W vs 749 W)
    and the median sits between the two halves, less than 5 % above the low ones.
    """
    (p75,) = [rule for rule in recording_rules() if rule["record"] == "node:pulse_gpu_power_watts:p75"]
    assert squash(p75["expr"]) == "quantile by (node) (0.75, pulse_gpu_power_watts)"
    (power,) = rules_named("GPUPowerBelowPeers")
    expr = squash(power["expr"])
    assert "node:pulse_gpu_power_watts:p75 >= 0.8 * quantile by (node) (0.5, pulse_gpu_power_limit_watts)" in expr
    assert "count by (node) (pulse_gpu_power_watts) >= 3" in expr


# ---- recording rules


def test_recording_rules_are_named_level_metric_operation() -> None:
    records = [rule["record"] for rule in recording_rules()]
    assert records, "no recording rules"
    assert len(records) == len(set(records)), f"duplicate recording rules: {records}"
    for record in records:
        assert RECORDING_NAME.match(record), f"{record}: expected level:metric:operation"


def _expressions_outside_recording() -> dict[str, str]:
    exprs = {f"alert {rule['alert']}": str(rule["expr"]) for rule in alert_rules()}
    for rule in alert_rules():
        for key, text in rule.get("annotations", {}).items():
            exprs[f"alert {rule['alert']} annotation {key}"] = str(text)
    for path in DASHBOARDS:
        dashboard = load_json(path)
        exprs[path.name] = json.dumps(dashboard)
    return exprs


def test_recording_rules_referenced_are_defined() -> None:
    defined = {rule["record"] for rule in recording_rules()}
    for where, text in _expressions_outside_recording().items():
        for ref in RECORDING_REF.findall(text):
            assert ref in defined, f"{where} uses {ref}, which no recording rule defines"


def test_every_recording_rule_is_used() -> None:
    used = {ref for text in _expressions_outside_recording().values() for ref in RECORDING_REF.findall(text)}
    unused = sorted({rule["record"] for rule in recording_rules()} - used)
    assert not unused, f"recording rules nothing reads: {unused}"


# ---- runbooks


@pytest.mark.parametrize("name", sorted(ALERT_SCOPES))
def test_runbook(name: str) -> None:
    path = RUNBOOKS / f"{name}.md"
    assert path.is_file(), f"runbook {path.relative_to(RUNBOOKS.parents[1])} is missing"
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"# {name}\n"), f"{path.name} must start with '# {name}'"
    for section in ("## What it means", "## First commands", "## When to cordon"):
        assert section in text, f"{path.name}: section {section!r} missing"
    assert "pulse nodes cordon" in text, f"{path.name}: say when to run `pulse nodes cordon NODE`"
    scope = ALERT_SCOPES[name]
    if scope in ("node", "gpu", "port"):
        assert "pulse nodes show NODE" in text, f"{path.name}: `pulse nodes show NODE` missing"
        assert "pulse events --node NODE" in text, f"{path.name}: `pulse events --node NODE` missing"
    if scope == "gpu":
        assert "nvidia-smi -q -d ECC,PERFORMANCE" in text, f"{path.name}: nvidia-smi command missing"
    if scope == "port":
        assert "ibstat DEVICE" in text, f"{path.name}: `ibstat DEVICE` (the port as the HCA sees it) missing"
    if name in ("PSUCurrentImbalance", "GPUPowerBelowPeers", "NodeDegraded"):
        assert 'ipmitool sdr type "Power Supply"' in text, f"{path.name}: ipmitool command missing"
    if scope == "job":
        assert "pulse jobs show JOB" in text or "pulse plan JOB" in text, f"{path.name}: job commands"
    if name in ("LossSpike", "GradNormExplosion"):  # keep the state before it diverges further
        first = text.split("## First commands", 1)[1].split("```sh\n", 1)[1].splitlines()[0]
        assert first.startswith("pulse jobs checkpoint JOB"), f"{path.name}: the first command is {first!r}"
        assert "POST /v1/jobs/{id}/checkpoint" in text, f"{path.name}: the REST form of the checkpoint"


def test_the_runbook_index_lists_every_alert() -> None:
    index = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| \[(\w+)\]\(\1\.md\) \|", index, flags=re.M))
    assert listed == {rule["alert"] for rule in alert_rules()}, sorted(listed ^ {r["alert"] for r in alert_rules()})


def test_no_runbook_without_alert() -> None:
    alerts = {rule["alert"] for rule in alert_rules()}
    orphans = sorted(p.name for p in RUNBOOKS.glob("*.md") if p.stem != "README" and p.stem not in alerts)
    assert not orphans, f"runbooks for alerts that do not exist: {orphans}"


# ---- unit-test coverage


def _unit_cases() -> dict[str, dict[str, list[tuple[str, dict[str, Any]]]]]:
    """alertname -> {"fires": [...], "silent": [...]}, each item (where, alert_rule_test entry)."""
    cases: dict[str, dict[str, list[tuple[str, dict[str, Any]]]]] = defaultdict(lambda: {"fires": [], "silent": []})
    for path in PROMTOOL_TESTS:
        for test in load_yaml(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                kind = "fires" if case.get("exp_alerts") else "silent"
                where = f"{path.name}: {test.get('name', '?')} @ {case['eval_time']}"
                cases[case["alertname"]][kind].append((where, case))
    return cases


@pytest.mark.parametrize("name", sorted(ALERT_SCOPES))
def test_every_alert_has_a_firing_and_a_silent_unit_test(name: str) -> None:
    cases = _unit_cases()[name]
    assert cases["fires"], f"{name}: no promtool case where it fires"
    assert cases["silent"], f"{name}: no promtool case where exp_alerts is empty (the near miss)"


def test_firing_cases_check_labels_and_annotations() -> None:
    rules_by_name = defaultdict(list)
    for rule in alert_rules():
        rules_by_name[rule["alert"]].append(rule)
    for name, cases in _unit_cases().items():
        assert name in rules_by_name, f"promtool tests exercise unknown alert {name}"
        for where, case in cases["fires"]:
            for expected in case["exp_alerts"]:
                labels = expected.get("exp_labels", {})
                annotations = expected.get("exp_annotations", {})
                assert labels.get("severity") in SEVERITIES, f"{where}: exp_labels lack severity"
                assert {"summary", "description", "runbook_url"} <= set(annotations), (
                    f"{where}: exp_annotations must give summary, description and runbook_url"
                )
