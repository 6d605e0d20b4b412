"""agent/nic_history.py: each counter's increase over two trailing windows, across resets,
host reboots and ports that go missing."""

from __future__ import annotations

from agent.nic_history import PortHistory, RawPort


def _port(symbol: int, downed: int = 0, device: str = "mlx5_0") -> RawPort:
    return RawPort(device=device, port=1, state="ACTIVE", counters={"symbol_error": symbol, "link_downed": downed})


def test_increases_over_each_window_and_the_seconds_they_cover() -> None:
    h = PortHistory(rate_window_s=10.0, error_window_s=100.0)
    [first] = h.fold([_port(5)], host_boot="b", now=0.0)
    assert (first.recent, first.recent_s, first.errors, first.errors_s) == ({}, 0.0, {}, 0.0)
    for t in range(1, 31):  # one symbol error a second
        [p] = h.fold([_port(5 + t)], host_boot="b", now=float(t))
    assert (p.recent, p.recent_s) == ({"symbol_error": 10}, 10.0)
    assert p.errors == {"symbol_error": 30} and p.errors_s == 30.0
    assert p.counters == {"symbol_error": 35, "link_downed": 0}
    for t in range(31, 200):  # quiet: the short window empties, the long one keeps what is in it
        [p] = h.fold([_port(35)], host_boot="b", now=float(t))
        if t == 45:
            assert p.recent == {} and p.errors == {"symbol_error": 30}
    assert (p.errors, p.errors_s) == ({}, 100.0)
    assert not h.ports[("mlx5_0", 1)].bursts  # a quiet port keeps nothing of its past errors


def test_a_counter_that_goes_down_was_reset_and_counts_on_from_its_new_value() -> None:
    h = PortHistory(rate_window_s=10.0, error_window_s=100.0)
    h.fold([_port(1000, downed=3)], host_boot="b", now=0.0)
    [p] = h.fold([_port(2, downed=3)], host_boot="b", now=1.0)  # cleared, then 2 more
    assert p.recent == {"symbol_error": 2} and p.counters["symbol_error"] == 2
    [p] = h.fold([_port(4, downed=4)], host_boot="b", now=2.0)
    assert p.recent == {"symbol_error": 4, "link_downed": 1}


def test_a_new_host_boot_starts_a_fresh_baseline() -> None:
    h = PortHistory(rate_window_s=10.0, error_window_s=100.0)
    h.fold([_port(10, downed=1)], host_boot="b1", now=0.0)
    [p] = h.fold([_port(500, downed=9)], host_boot="b2", now=1.0)
    assert (p.recent, p.errors, p.recent_s) == ({}, {}, 0.0)
    [p] = h.fold([_port(501, downed=9)], host_boot="b2", now=2.0)
    assert p.recent == {"symbol_error": 1}


def test_a_missing_port_is_published_with_its_last_values_and_counted_until_a_reboot() -> None:
    h = PortHistory(rate_window_s=10.0, error_window_s=100.0)
    h.fold([_port(1), _port(1, device="mlx5_1")], host_boot="b", now=0.0)
    for n in (1, 2, 3):
        ports = h.fold([_port(1)], host_boot="b", now=float(n))
        gone = [p for p in ports if p.device == "mlx5_1"]
        assert [(p.missing, p.state, p.recent) for p in gone] == [(n, "ACTIVE", {})]
    [back] = [p for p in h.fold([_port(1), _port(3, device="mlx5_1")], host_boot="b", now=4.0) if p.device == "mlx5_1"]
    assert back.missing == 0 and back.recent == {"symbol_error": 2}
    assert [p.device for p in h.fold([_port(1)], host_boot="b2", now=5.0)] == ["mlx5_0"]
