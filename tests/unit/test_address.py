"""How an agent finds the address its peers reach it at (agent/address.py), with the kernel's
answers replaced by hand, plus one real look-up."""

from __future__ import annotations

from agent.address import DEFAULT_ROUTE_PROBE, choose, discover, is_loopback, route_source


def test_the_first_address_that_is_not_loopback_wins() -> None:
    assert choose([("redis", "10.0.0.5"), ("default", "192.168.1.2"), ("name", "10.9.9.9")]) == ("10.0.0.5", "redis")
    assert choose([("redis", "127.0.0.1"), ("default", None), ("name", "10.9.9.9")]) == ("10.9.9.9", "name")
    assert choose([("redis", "127.0.0.1"), ("default", None), ("name", "127.0.1.1")]) == ("127.0.0.1", "redis")
    assert choose([("redis", None), ("default", None), ("name", None)]) == ("127.0.0.1", "nothing found")
    assert choose([("redis", "::1"), ("default", "fd00::7")]) == ("fd00::7", "default")


def test_loopback() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(is_loopback(a) for a in ("10.0.0.1", "fd00::1", "fe80::1%eth0", "bar-j1"))


def test_discover_asks_the_route_to_redis_first_then_the_default_route_then_the_host_name() -> None:
    asked: list[str] = []

    def route(table: dict[str, str | None]):  # type: ignore[no-untyped-def]
        def look(host: str) -> str | None:
            asked.append(host)
            return table.get(host)

        return look

    got = discover("redis://redis.cluster:6379/0", route=route({"redis.cluster": "10.0.0.5"}), hostname=lambda: None)
    assert got == ("10.0.0.5", "route to the Redis host redis.cluster")
    asked.clear()
    got = discover(
        "redis://user:pw@127.0.0.1:6379/0",
        route=route({"127.0.0.1": "127.0.0.1", DEFAULT_ROUTE_PROBE: "172.17.0.3"}),
        hostname=lambda: "127.0.1.1",
    )
    assert got == ("172.17.0.3", "default route") and asked == ["127.0.0.1", DEFAULT_ROUTE_PROBE]
    got = discover("unix:///run/redis.sock", route=route({}), hostname=lambda: "10.1.2.3")
    assert got == ("10.1.2.3", "host name")
    assert discover("redis://127.0.0.1/0", route=route({"127.0.0.1": "127.0.0.1"}), hostname=lambda: None) == (
        "127.0.0.1",
        "route to the Redis host 127.0.0.1",
    )


def test_route_source_is_the_kernels_answer_and_none_when_it_has_none() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"  # a UDP connect: nothing is sent
    assert route_source("bar-j1.invalid") is None  # RFC 6761: never resolves
