"""Grafana: dashboards are valid, self-consistent JSON; provisioning matches docker-compose."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    COMPOSE_FILE,
    DASHBOARDS,
    GRAFANA,
    all_panels,
    dashboard_exprs,
    load_json,
    load_yaml,
    run_tool,
    tool_output,
)

DATASOURCE = "${datasource}"
BY_NAME = {path.name: path for path in DASHBOARDS}
OVERVIEW, NODE, JOB = "cluster-overview.json", "node-detail.json", "training-job.json"


def dashboard(name: str) -> dict[str, Any]:
    assert name in BY_NAME, f"dashboard {name} missing; have {sorted(BY_NAME)}"
    return load_json(BY_NAME[name])


def variables(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in d.get("templating", {}).get("list", [])}


def panels_using(d: dict[str, Any], metric: str) -> list[dict[str, Any]]:
    return [p for p in all_panels(d) if any(metric in t.get("expr", "") for t in p.get("targets", []))]


def test_the_three_dashboards_exist() -> None:
    assert {OVERVIEW, NODE, JOB} <= set(BY_NAME)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    d = load_json(path)
    assert isinstance(d.get("schemaVersion"), int) and d["schemaVersion"] >= 36, "schemaVersion"
    assert d.get("uid") and d.get("title"), "uid and title are required"
    assert "id" not in d or d["id"] is None, "provisioned dashboards carry no database id"
    panels = all_panels(d)
    assert panels, "no panels"
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), f"every panel needs an integer id: {ids}"
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for p in panels:
        pos = p.get("gridPos", {})
        assert {"h", "w", "x", "y"} <= set(pos), f"panel {p['id']}: gridPos"
        assert pos["x"] + pos["w"] <= 24, f"panel {p['id']} overflows the 24-column grid"
        assert p.get("title"), f"panel {p['id']}: title"


def test_dashboard_uids_and_titles_are_unique() -> None:
    boards = [load_json(p) for p in DASHBOARDS]
    for key in ("uid", "title"):
        values = [b[key] for b in boards]
        assert len(values) == len(set(values)), f"duplicate dashboard {key}: {values}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_uses_the_datasource_variable(path: Path) -> None:
    d = load_json(path)
    ds = variables(d).get("datasource")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", "datasource variable"
    for p in all_panels(d):
        if p["type"] == "row":
            continue
        assert p.get("datasource", {}).get("uid") == DATASOURCE, f"panel {p['id']} {p['title']!r}"
        assert p.get("targets"), f"panel {p['id']} {p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("datasource", {}).get("uid") == DATASOURCE, f"panel {p['id']} target {t.get('refId')}"
            assert t.get("expr", "").strip(), f"panel {p['id']} target {t.get('refId')}: empty expr"
    for v in variables(d).values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == DATASOURCE, f"variable {v['name']}"


@pytest.mark.parametrize(
    ("name", "var", "metric"), [(NODE, "node", "pulse_node_state"), (JOB, "job", "pulse_job_state")]
)
def test_scoped_dashboards_filter_by_their_variable(name: str, var: str, metric: str) -> None:
    d = dashboard(name)
    v = variables(d).get(var)
    assert v and v["type"] == "query", f"{name}: query variable {var!r} missing"
    query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    assert query == f"label_values({metric}, {var})"
    for p in all_panels(d):
        for t in p.get("targets", []):
            assert f'{var}="${var}"' in t["expr"], f"{name} panel {p['title']!r}: {t['expr']} ignores ${var}"


def test_cluster_overview_content() -> None:
    d = dashboard(OVERVIEW)
    assert panels_using(d, "pulse_nodes"), "nodes by state"
    assert any(p["type"] == "table" for p in panels_using(d, "pulse_node_state")), "degraded-node table"
    assert any(p["type"] == "heatmap" for p in panels_using(d, "pulse_node_heartbeat_age_seconds")), "heatmap"
    assert panels_using(d, "pulse_partition_suspected"), "partition status"


def test_node_detail_content() -> None:
    d = dashboard(NODE)
    for metric in (
        "pulse_gpu_utilization_ratio",
        "pulse_gpu_temperature_celsius",
        "pulse_gpu_power_watts",
        "pulse_gpu_throttle_active",
        "pulse_psu_output_current_amperes",
        "pulse_psu_input_current_amperes",
        "pulse_gpu_ecc_errors_total",
        "pulse_gpu_xid_errors_total",
        "pulse_nic_port_up",
        "pulse_nic_port_rate_gbps",
        "pulse_nic_errors_total",
        "pulse_nic_data_bytes_total",
    ):
        assert panels_using(d, metric), f"node detail: no panel for {metric}"
    both = [
        p
        for p in panels_using(d, "pulse_gpu_pcie_link_width_max")
        if any(re.search(r"pulse_gpu_pcie_link_width\b(?!_)", t["expr"]) for t in p["targets"])
    ]
    assert both, "node detail: PCIe width and its max in one panel"


def test_training_job_content() -> None:
    d = dashboard(JOB)
    for metric in (
        "pulse_job_mfu_ratio",
        "pulse_job_step_time_seconds",
        "pulse_job_tokens_per_second",
        "pulse_job_loss",
        "pulse_job_grad_norm",
        "pulse_job_plan_generation",
        "pulse_job_proxied_ranks",
        "pulse_job_excluded_ranks",
    ):
        assert panels_using(d, metric), f"training job: no panel for {metric}"
    threshold_lines = [
        p
        for p in panels_using(d, "pulse_job_mfu_ratio")
        if p["type"] == "timeseries"
        and p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
        and 0.3 in [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    ]
    assert threshold_lines, "training job: MFU graph with a threshold line at 0.3"


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Every panel query parses (Grafana variables substituted), checked by promtool."""
    substitutes = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
    rules = []
    for path in DASHBOARDS:
        for i, expr in enumerate(dashboard_exprs(load_json(path))):
            concrete = re.sub(r"\$\{?(\w+)\}?", lambda m: substitutes.get(m.group(1), "x"), expr)
            rules.append({"record": f"dashboard:{path.stem.replace('-', '_')}:expr{i}", "expr": concrete})
    rule_file = tmp_path / "dashboard-queries.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = run_tool(promtool, "check", "rules", rule_file)
    assert proc.returncode == 0, tool_output(proc)


# ---- provisioning


def grafana_mounts() -> dict[str, str]:
    """Container path -> host path (relative to the repo) of the grafana service's bind mounts."""
    mounts = {}
    for volume in load_yaml(COMPOSE_FILE)["services"]["grafana"]["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[target] = source
    return mounts


def test_datasource_provisioning() -> None:
    files = sorted((GRAFANA / "provisioning" / "datasources").glob("*.yml"))
    assert files
    sources = [ds for f in files for ds in load_yaml(f)["datasources"]]
    prometheus = [ds for ds in sources if ds["type"] == "prometheus"]
    assert len(prometheus) == 1 and prometheus[0].get("isDefault") is True
    assert prometheus[0]["url"] == "http://prometheus:9090"  # the compose service
    assert "/etc/grafana/provisioning" in grafana_mounts()


def test_dashboard_provisioning_points_at_the_mounted_dashboards() -> None:
    files = sorted((GRAFANA / "provisioning" / "dashboards").glob("*.yml"))
    assert files
    providers = [p for f in files for p in load_yaml(f)["providers"]]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    path = providers[0]["options"]["path"]
    assert grafana_mounts().get(path) == "./deploy/grafana/dashboards", (
        f"provider path {path} is not where docker-compose mounts deploy/grafana/dashboards"
    )
