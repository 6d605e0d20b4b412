"""deploy/alertmanager/alertmanager.yml: valid, routes by severity, inhibits as documented.

Inhibition is checked by evaluating the configured rules with the Alertmanager semantics
(anchored regexes, `equal` labels, an alert never inhibits itself) on example alerts.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from deploy_files import ALERTMANAGER_CONFIG, SPEC_ALERTS, load_yaml, run_tool, tool_output

MATCHER = re.compile(r'^\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"?(.*?)"?\s*$')
GPU_ALERTS = sorted(name for name, scope in SPEC_ALERTS.items() if scope == "gpu")


def config() -> dict[str, Any]:
    return load_yaml(ALERTMANAGER_CONFIG)


def matches(matcher: str, labels: dict[str, str]) -> bool:
    m = MATCHER.match(matcher)
    assert m, f"cannot parse matcher {matcher!r}"
    name, op, value = m.groups()
    actual = labels.get(name, "")
    if op == "=":
        return actual == value
    if op == "!=":
        return actual != value
    found = re.fullmatch(value, actual) is not None
    return found if op == "=~" else not found


def inhibited(target: dict[str, str], firing: list[dict[str, str]]) -> bool:
    for rule in config().get("inhibit_rules", []):
        if not all(matches(m, target) for m in rule.get("target_matchers", [])):
            continue
        for source in firing:
            if source is target or not all(matches(m, source) for m in rule.get("source_matchers", [])):
                continue
            if all(source.get(label, "") == target.get(label, "") for label in rule.get("equal", [])):
                return True
    return False


def alert(name: str, **labels: str) -> dict[str, str]:
    return {"alertname": name, **labels}


def test_amtool_check_config(amtool: str) -> None:
    proc = run_tool(amtool, "check-config", ALERTMANAGER_CONFIG)
    assert proc.returncode == 0, tool_output(proc)


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=NodeLost", "node=gpu-node-01"], "pager"),
        (["severity=warning", "alertname=NodeDegraded", "node=gpu-node-01"], "tickets"),
        (["severity=info", "alertname=Something"], "default"),
    ],
)
def test_routes_by_severity(amtool: str, labels: list[str], receiver: str) -> None:
    proc = run_tool(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels)
    assert proc.returncode == 0, tool_output(proc)
    assert proc.stdout.split() == [receiver], tool_output(proc)


def test_groups_by_node_and_job() -> None:
    assert {"node", "job"} <= set(config()["route"]["group_by"])


def test_every_receiver_is_a_webhook() -> None:
    receivers = config()["receivers"]
    assert receivers
    for receiver in receivers:
        hooks = receiver.get("webhook_configs", [])
        assert hooks and all(h["url"].startswith(("http://", "https://")) for h in hooks), receiver["name"]


@pytest.mark.parametrize("target", ["NodeDegraded", "NodeHeartbeatStale", *GPU_ALERTS])
def test_node_lost_silences_that_nodes_alerts(target: str) -> None:
    lost = alert("NodeLost", node="gpu-node-01", severity="critical")
    assert inhibited(alert(target, node="gpu-node-01", gpu="3", severity="warning"), [lost])
    assert not inhibited(alert(target, node="gpu-node-02", gpu="3", severity="warning"), [lost])


def test_node_lost_does_not_silence_other_alerts() -> None:
    lost = alert("NodeLost", node="gpu-node-01", severity="critical")
    assert not inhibited(lost, [lost])
    assert not inhibited(alert("LowMFU", job="job-a", severity="critical"), [lost])
    assert not inhibited(alert("NodeLost", node="gpu-node-02", severity="critical"), [lost])


@pytest.mark.parametrize("target", ["NodeHeartbeatStale", "NodeDegraded", "NodeLost"])
def test_partition_silences_per_node_heartbeat_alerts(target: str) -> None:
    partition = alert("ControlPlanePartition", instance="orchestrator:8000", severity="critical")
    assert inhibited(alert(target, node="gpu-node-01", severity="critical"), [partition])
    assert inhibited(alert(target, node="gpu-node-07", severity="warning"), [partition])


@pytest.mark.parametrize("target", ["GPUECCUncorrectable", "PSUCurrentImbalance", "LowMFU", "OrchestratorDown"])
def test_partition_keeps_hardware_and_job_alerts(target: str) -> None:
    partition = alert("ControlPlanePartition", instance="orchestrator:8000", severity="critical")
    assert not inhibited(alert(target, node="gpu-node-01", gpu="0", job="job-a", severity="critical"), [partition])
