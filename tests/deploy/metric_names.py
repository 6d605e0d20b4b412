"""Which ``pulse_*`` metrics the deployment files query.

:func:`metric_names_used` reads the alerting and recording rules and the Grafana dashboards and
returns every orchestrator metric name their PromQL refers to, without the recording rules'
own outputs (``level:metric:operation`` names such as ``node:pulse_gpu_power_watts:p75``).
A live test compares it with what ``/metrics`` exports, so that a renamed metric cannot leave
an alert silently matching nothing.

Self-contained on purpose (only PyYAML), so that any test can load it by path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULE_FILES = (DEPLOY / "prometheus" / "alerts.yml", DEPLOY / "prometheus" / "recording.yml")
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"

# A bare metric name: not part of a longer identifier and not a piece of a colon-separated
# recording-rule name.
_METRIC = re.compile(r"(?<![\w:])pulse_\w+(?![\w:])")


def _rule_exprs(path: Path) -> tuple[list[str], set[str]]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    exprs: list[str] = []
    records: set[str] = set()
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            exprs.append(str(rule["expr"]))
            if "record" in rule:
                records.add(rule["record"])
    return exprs, records


def _dashboard_exprs(node: Any) -> Iterator[str]:
    """Panel target ``expr`` strings and template-variable queries, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                yield value
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def metric_names_by_file() -> dict[str, frozenset[str]]:
    """``{file path relative to deploy/: metric names it uses}`` for every rule file and dashboard."""
    rule_sources = {path: _rule_exprs(path) for path in RULE_FILES}
    records = set().union(*(recs for _, recs in rule_sources.values()))
    out: dict[str, frozenset[str]] = {}
    for path, (exprs, _) in rule_sources.items():
        out[path.relative_to(DEPLOY).as_posix()] = _names(exprs, records)
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        out[path.relative_to(DEPLOY).as_posix()] = _names(_dashboard_exprs(dashboard), records)
    return out


def metric_names_used() -> frozenset[str]:
    """Every ``pulse_*`` metric referenced by alerts, recording rules and dashboards."""
    return frozenset().union(*metric_names_by_file().values())


def _names(exprs: Iterable[str], records: set[str]) -> frozenset[str]:
    return frozenset(name for expr in exprs for name in _METRIC.findall(expr)) - records
