"""The ``pulse`` subcommands that run a process (``agent``, ``simulate``, ``orchestrator``,
``ingest``) or set one up (``db``, ``agent-credentials``). Each imports what it runs only when it
runs, so ``pulse agent`` stays small."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from clusterpulse.settings import Settings, load_settings


def settings_with(**overrides: Any) -> Settings:
    """The settings, with the flags that were given (``None``: not given) over the environment."""
    return load_settings(**{k: v for k, v in overrides.items() if v is not None})


async def _until_signal(main: Callable[[asyncio.Event], Any]) -> None:
    """Run ``main(stop)``; SIGINT/SIGTERM set ``stop`` for a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await main(stop)


def cmd_agent(args: argparse.Namespace) -> int:
    from agent.daemon import parse_labels, run_node_agent
    from agent.simulated import parse_fault
    from clusterpulse import wire

    if args.addr is not None and not wire.valid_addr(args.addr):
        raise SystemExit(f"pulse agent: --addr {args.addr!r}: expected a host name or an IP address, no port")
    settings = settings_with(heartbeat_interval_s=args.interval, agent_addr=args.addr)
    faults = [parse_fault(f) for f in args.fault]
    if faults and args.source != "simulated":
        raise SystemExit("pulse agent: --fault needs --source simulated")
    for f in faults:
        if f.node not in (None, args.node):
            raise SystemExit(f"pulse agent: --fault {f.node}=...: this agent is {args.node}")
    labels = parse_labels(args.label)
    asyncio.run(
        _until_signal(
            lambda stop: run_node_agent(
                settings,
                node=args.node,
                source=args.source,
                gpus=args.gpus,
                interval_s=settings.heartbeat_interval_s,
                labels=labels,
                faults=faults,
                stop=stop,
                jobs=not args.no_jobs,
            )
        )
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.daemon import run_simulation
    from agent.simulated import parse_fault

    settings = settings_with(heartbeat_interval_s=args.interval)
    faults = [parse_fault(f) for f in args.fault]

    async def main(stop: asyncio.Event) -> None:
        if args.duration:
            asyncio.get_running_loop().call_later(args.duration, stop.set)
        await run_simulation(
            settings,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            interval_s=settings.heartbeat_interval_s,
            faults=faults,
            prefix=args.prefix,
            stop=stop,
        )

    asyncio.run(_until_signal(main))
    return 0


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from services.api.app import create_app
    from services.api.server import serve

    settings = settings_with()
    serve(create_app(settings), settings, host=args.host, port=args.port)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    """One ingest process (services/ingest/worker.py), for a leader whose replicas run with
    PULSE_INGEST_PROCESSES > 0, on any host that reaches Redis."""
    from services.ingest import worker as ingest_worker

    asyncio.run(ingest_worker.run(settings_with()))
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from services import db
    from services.api.routes.common import redact

    settings = settings_with()
    db.ensure_sqlite_dir(settings.database_url)
    head = db.upgrade(settings.database_url)
    print(f"database {redact(settings.database_url)} at revision {head}")
    return 0


def _credentials_password(path: str | None) -> str:
    """The password in ``path``; a new one when no path is given, or written there (0600) when the
    file does not exist yet."""
    from pathlib import Path

    from clusterpulse import acl

    if path is None:
        return acl.new_password()
    file = Path(path)
    if file.exists():
        password = file.read_text().strip()
        if not password:
            raise SystemExit(f"pulse agent-credentials: --password-file {path} is empty; expected a password")
        return password
    password = acl.new_password()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def cmd_agent_credentials(args: argparse.Namespace) -> int:
    from clusterpulse import acl

    if args.orchestrator == bool(args.node):
        raise SystemExit("pulse agent-credentials: give a NODE or --orchestrator (one of the two)")
    settings = settings_with()
    password = _credentials_password(args.password_file)
    try:
        rules = (
            acl.orchestrator_acl(password=password, cluster=settings.redis_cluster)
            if args.orchestrator
            else acl.node_acl(
                args.node, shards=settings.heartbeat_stream_shards, password=password, cluster=settings.redis_cluster
            )
        )
    except ValueError as exc:
        raise SystemExit(f"pulse agent-credentials: {exc}") from None
    url = acl.credentials_url(settings.redis_url, username=rules[0], password=password)
    if args.apply:
        import redis

        from clusterpulse.redis_client import set_acl_user

        try:
            where = set_acl_user(
                settings.redis_url, rules, cluster=settings.redis_cluster, timeout_s=settings.redis_timeout_s
            )
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            print(f"pulse agent-credentials: ACL SETUSER {rules[0]} failed at PULSE_REDIS_URL: {exc}", file=sys.stderr)
            return 1
        if settings.redis_cluster:
            print(f"ACL user {rules[0]} set on every node of the Redis Cluster: {', '.join(where)}", file=sys.stderr)
        print(
            f"ACL user {rules[0]} applied (heartbeat_stream_shards={settings.heartbeat_stream_shards}); persist it "
            "with ACL SAVE (aclfile) or CONFIG REWRITE. Its URL, holding the password:",
            file=sys.stderr,
        )
    else:
        print(
            f"# ACL user {rules[0]} (heartbeat_stream_shards={settings.heartbeat_stream_shards}); apply the first "
            "line with redis-cli as an admin, or run again with --apply. The second line holds the password.",
            file=sys.stderr,
        )
        print(acl.redis_cli_line(rules))
    print(f"PULSE_REDIS_URL={url}")
    return 0
