"""deploy/prometheus/prometheus.yml: valid, scrapes the orchestrator, loads the rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploy_files import (
    ALERTS_FILE,
    COMPOSE_FILE,
    ORCHESTRATOR_SCRAPE_JOB,
    PROMETHEUS,
    PROMETHEUS_CONFIG,
    RECORDING_FILE,
    load_yaml,
    run_tool,
    tool_output,
)


def scrape_job(name: str) -> dict[str, Any]:
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    assert name in jobs, f"no scrape job {name!r}; have {sorted(jobs)}"
    return jobs[name]


@pytest.mark.parametrize("config", [PROMETHEUS_CONFIG, PROMETHEUS / "scrape-sharded.yml"], ids=lambda p: p.name)
def test_promtool_check_config(promtool: str, config: Path) -> None:
    proc = run_tool(promtool, "check", "config", config)
    assert proc.returncode == 0, tool_output(proc)


def test_rule_files_are_loaded() -> None:
    loaded = {(PROMETHEUS / f).resolve() for f in load_yaml(PROMETHEUS_CONFIG)["rule_files"]}
    assert loaded == {ALERTS_FILE.resolve(), RECORDING_FILE.resolve()}


def test_orchestrator_scrape_job() -> None:
    job = scrape_job(ORCHESTRATOR_SCRAPE_JOB)
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["orchestrator:8000"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # pulse_job_* series carry job=<job id>; without honor_labels Prometheus would rename it
    # to exported_job and every job alert and dashboard would match nothing.
    assert job.get("honor_labels") is True


def test_targets_are_compose_services() -> None:
    services = load_yaml(COMPOSE_FILE)["services"]
    config = load_yaml(PROMETHEUS_CONFIG)
    alertmanagers = [
        t for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"] for t in sc["targets"]
    ]
    assert alertmanagers == ["alertmanager:9093"]
    for job in config["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host = target.split(":")[0]
                assert host == "localhost" or host in services, f"{job['job_name']}: {target} is no compose service"
