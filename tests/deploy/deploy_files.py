"""Paths, loaders and SPEC facts shared by the deployment-file tests.

Everything here reads files only: no network, no Docker, no import of the application (its
settings and wire contract are read with ``ast``, so these tests run without the package
installed and without its dependencies).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
ALERTS_FILE = PROMETHEUS / "alerts.yml"
RECORDING_FILE = PROMETHEUS / "recording.yml"
PROMETHEUS_CONFIG = PROMETHEUS / "prometheus.yml"
PROMTOOL_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
RUNBOOKS = DEPLOY / "runbooks"
GRAFANA = DEPLOY / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
K8S = DEPLOY / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"

RUNBOOK_BASE = "https://github.com/clusterpulse/clusterpulse/blob/main/deploy/runbooks/"
ORCHESTRATOR_SCRAPE_JOB = "clusterpulse-orchestrator"

# SPEC.md, "Alerts" (and the network ports of its third round): the fixed alert names, with what
# each one is about (its description must name it). "port" alerts concern one network port of a
# node (labels node, device, port); "cluster" alerts the control plane as a whole.
SPEC_ALERTS: dict[str, str] = {
    "LowMFU": "job",
    "NodeDegraded": "node",
    "NodeLost": "node",
    "NodeHeartbeatStale": "node",
    "GPUTemperatureHigh": "gpu",
    "GPUThermalThrottling": "gpu",
    "GPUPowerBelowPeers": "gpu",
    "PSUCurrentImbalance": "node",
    "PCIeLinkDowngraded": "gpu",
    "GPUECCUncorrectable": "gpu",
    "GPUXidError": "gpu",
    "TrainerStalled": "job",
    "LossSpike": "job",
    "GradNormExplosion": "job",
    "ControlPlanePartition": "cluster",
    "OrchestratorDown": "cluster",
    "SlurmDrainBreakerOpen": "cluster",
    "SlurmSyncFailing": "cluster",
    "NICLinkDown": "port",
    "NICRateDegraded": "port",
    "NICErrorsRising": "port",
    "NCCLOverTCP": "port",
}
# Alerts of ClusterPulse's own beside SPEC's, held to the same rules (metadata, runbook, unit tests).
OWN_ALERTS: dict[str, str] = {
    "GPUDegraded": "gpu",
    "JobDataBound": "job",
    "JobCommunicationBound": "job",
    "OrchestratorLoopStalled": "cluster",
}
ALERT_SCOPES = {**SPEC_ALERTS, **OWN_ALERTS}
PER_NODE_HEARTBEAT_ALERTS = ("NodeHeartbeatStale", "NodeDegraded", "NodeLost")
LOW_MFU_EXPR = "avg_over_time(pulse_job_mfu_ratio[5m]) < 0.3"
LOW_MFU_FOR = "15m"

# Level:metric:operation, e.g. node:pulse_gpu_power_watts:p75.
RECORDING_NAME = re.compile(r"^[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*$")
RECORDING_REF = re.compile(r"(?<![\w:])[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*(?![\w:])")


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of alerts.yml (an alert name may have several rules)."""
    return [rule for rule in rules(ALERTS_FILE) if "alert" in rule]


def recording_rules() -> list[dict[str, Any]]:
    return [rule for path in (RECORDING_FILE, ALERTS_FILE) for rule in rules(path) if "record" in rule]


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a nested JSON-like structure."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Top-level panels plus those nested in (collapsed) rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for panel in all_panels(dashboard) for t in panel.get("targets", []) if "expr" in t]


# ---- the application's own facts, read without importing it


def _module_ast(relative: str) -> ast.Module:
    return ast.parse((REPO / relative).read_text(encoding="utf-8"), filename=relative)


@cache
def settings_defaults() -> dict[str, object]:
    """``Settings`` field name -> default, from clusterpulse/settings.py (``None`` if not literal)."""
    module = _module_ast("clusterpulse/settings.py")
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    fields: dict[str, object] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and value.args:  # Field(default, ...)
            value = value.args[0]
        try:
            fields[stmt.target.id] = ast.literal_eval(value) if value is not None else None
        except ValueError:
            fields[stmt.target.id] = None
    return fields


def settings_env_names() -> set[str]:
    """The PULSE_* environment variables that the settings object reads."""
    return {f"PULSE_{name.upper()}" for name in settings_defaults()}


@cache
def fatal_xids() -> frozenset[int]:
    """``clusterpulse.wire.FATAL_XIDS``."""
    for stmt in _module_ast("clusterpulse/wire.py").body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FATAL_XIDS" for t in stmt.targets):
            call = stmt.value
            assert isinstance(call, ast.Call), "FATAL_XIDS is expected to be frozenset({...})"
            return frozenset(ast.literal_eval(call.args[0]))
    raise AssertionError("FATAL_XIDS not found in clusterpulse/wire.py")


# ---- external tools


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"{name} is not on PATH (Debian: apt-get install prometheus prometheus-alertmanager); CI installs it"
        )
    return path


def run_tool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd)


def tool_output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
