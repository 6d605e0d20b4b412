"""The thresholds the alert rules write in PromQL are the health model's own: each number in
deploy/prometheus is read here and compared with services/health/decide.py and the settings' defaults,
so changing one without the other fails."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from services.health import decide as health
from services.health.decide import Policy

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _rules(name: str) -> dict[str, str]:
    doc: dict[str, Any] = yaml.safe_load((PROMETHEUS / name).read_text())
    return {
        r.get("alert") or r["record"]: " ".join(str(r["expr"]).split())
        for group in doc["groups"]
        for r in group["rules"]
    }


def _number(expr: str, pattern: str) -> float:
    m = re.search(pattern, expr)
    assert m, f"{pattern!r} not in {expr!r}"
    return float(m.group(1))


def test_gpu_power_below_peers_is_the_health_models_peer_rule() -> None:
    alerts, recording = _rules("alerts.yml"), _rules("recording.yml")
    p75 = recording["node:pulse_gpu_power_watts:p75"]
    assert _number(p75, r"quantile by \(node\) \(([\d.]+), pulse_gpu_power_watts\)") == health.PEER_QUANTILE
    expr = alerts["GPUPowerBelowPeers"]
    gap = Policy().power_peer_gap
    assert _number(expr, r"\(([\d.]+) \* node:pulse_gpu_power_watts:p75\)") == round(1 - gap, 6)
    assert _number(expr, r"pulse_gpu_utilization_ratio >= ([\d.]+)") == health.BUSY_UTILIZATION
    assert _number(expr, r">= ([\d.]+) \* quantile by \(node\) \(0\.5, pulse_gpu_power_limit_watts\)") == (
        health.LOADED_LIMIT_FRACTION
    )
    assert _number(expr, r"count by \(node\) \(pulse_gpu_power_watts\) >= (\d+)") == health.MIN_PEERS


def test_temperature_and_psu_alerts_use_the_default_policy() -> None:
    alerts = _rules("alerts.yml")
    policy = Policy()
    assert _number(alerts["GPUTemperatureHigh"], r"pulse_gpu_temperature_celsius > ([\d.]+)") == policy.temperature_warn
    psu = alerts["PSUCurrentImbalance"]
    assert _number(psu, r'side="output"\} > ([\d.]+)') == policy.psu_output_imbalance
    assert _number(psu, r'side="input"\} > ([\d.]+)') == policy.psu_input_imbalance


def test_policy_defaults_are_the_settings_defaults() -> None:
    from clusterpulse.settings import Settings

    s = Settings.model_construct()
    assert Policy() == Policy.from_settings(s)
