"""metric_names_used(): what the rules and dashboards query is what the orchestrator exports."""

from __future__ import annotations

from metric_names import metric_names_by_file, metric_names_used

# SPEC.md "Metrics" (and its network ports) plus the series the orchestrator documents alongside them.
EXPORTED = frozenset(
    {
        "pulse_event_loop_lag_seconds_bucket",  # a histogram's series (services/loop_watch.py)
        "pulse_event_loop_lag_seconds_count",
        "pulse_event_loop_lag_seconds_sum",
        "pulse_node_state",
        "pulse_nodes",
        "pulse_node_heartbeat_age_seconds",
        "pulse_node_schedulable",
        "pulse_node_clock_skew_seconds",
        "pulse_gpu_utilization_ratio",
        "pulse_gpu_temperature_celsius",
        "pulse_gpu_power_watts",
        "pulse_gpu_power_limit_watts",
        "pulse_gpu_memory_used_bytes",
        "pulse_gpu_memory_total_bytes",
        "pulse_gpu_pcie_link_width",
        "pulse_gpu_pcie_link_width_max",
        "pulse_gpu_sm_clock_hertz",
        "pulse_gpu_lost",
        "pulse_gpu_ecc_errors_total",
        "pulse_gpu_xid_errors_total",
        "pulse_gpu_throttle_active",
        "pulse_gpu_state",
        "pulse_psu_output_current_amperes",
        "pulse_psu_input_current_amperes",
        "pulse_psu_input_power_watts",
        "pulse_psu_ok",
        "pulse_fan_speed_rpm",
        "pulse_nic_port_up",
        "pulse_nic_port_rate_gbps",
        "pulse_nic_port_info",
        "pulse_nic_errors_total",
        "pulse_nic_data_bytes_total",
        "pulse_job_state",
        "pulse_job_mfu_ratio",
        "pulse_job_step",
        "pulse_job_step_time_seconds",
        "pulse_job_tokens_per_second",
        "pulse_job_loss",
        "pulse_job_grad_norm",
        "pulse_job_update_ratio",
        "pulse_job_plan_generation",
        "pulse_job_proxied_ranks",
        "pulse_job_excluded_ranks",
        "pulse_job_step_phase_seconds",
        "pulse_job_bottleneck",
        "pulse_job_bottleneck_info",
        "pulse_heartbeats_received_total",
        "pulse_heartbeats_rejected_total",
        "pulse_health_transitions_total",
        "pulse_partition_suspected",
        "pulse_leader",
        "pulse_slurm_drained_nodes",
        "pulse_slurm_sync_errors_total",
        "pulse_slurm_drain_breaker_open",
    }
)


def test_every_used_metric_is_exported() -> None:
    for source, names in metric_names_by_file().items():
        unknown = sorted(names - EXPORTED)
        assert not unknown, f"{source} queries metrics the orchestrator does not export: {unknown}"


def test_recording_rule_outputs_are_stripped() -> None:
    used = metric_names_used()
    assert all(":" not in name for name in used)
    assert "node:pulse_gpu_power_watts:p75" not in used


def test_sources_are_all_read() -> None:
    sources = metric_names_by_file()
    assert {"prometheus/alerts.yml", "prometheus/recording.yml"} <= set(sources)
    assert sum(s.startswith("grafana/dashboards/") for s in sources) >= 3
    assert all(sources.values()), f"a source with no metric at all: {sources}"


def test_alert_inputs_are_found() -> None:
    used = metric_names_used()
    for name in (
        "pulse_job_mfu_ratio",
        "pulse_partition_suspected",
        "pulse_psu_input_current_amperes",  # only through a recording rule
        "pulse_gpu_xid_errors_total",
        "pulse_nodes",  # only in a dashboard
        "pulse_nic_port_info",  # only through a recording rule
        "pulse_nic_data_bytes_total",
    ):
        assert name in used, name
