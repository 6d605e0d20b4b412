"""`pulse tokens create|list|revoke` against a real orchestrator process."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.stack import TOKEN, Stack
from tests.support import PULSE, REDIS_URL, REPO, stop

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Stack(tmp_path, PULSE_AUTH_READS="true")
    s.orchestrator()
    try:
        yield s
    finally:
        for p in s.procs.values():
            stop(p)


def pulse(stack: Stack, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {**stack.env, "PULSE_API_URL": stack.api, "PULSE_API_TOKEN": token}
    return subprocess.run([*PULSE, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=30, check=False)


def test_create_list_revoke_with_the_cli(stack: Stack) -> None:
    out = pulse(stack, "tokens", "create", "--name", "oncall", "--role", "operator")
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip()  # the secret alone on stdout
    assert secret.startswith("pulse_") and "shown only this once" in out.stderr

    listed = pulse(stack, "tokens", "list")
    assert listed.returncode == 0 and "oncall" in listed.stdout and "operator" in listed.stdout
    assert secret not in listed.stdout
    data = json.loads(pulse(stack, "tokens", "list", "--json").stdout)
    assert [(t["name"], t["active"]) for t in data["data"]] == [("oncall", True)]

    # the new token reads and is refused admin calls with the role it needs
    assert pulse(stack, "nodes", "list", token=secret).returncode == 0
    refused = pulse(stack, "tokens", "list", token=secret)
    assert refused.returncode != 0 and "403" in refused.stderr and "needs role admin" in refused.stderr

    assert pulse(stack, "tokens", "revoke", "oncall").stdout.strip() == "token oncall revoked"
    again = pulse(stack, "tokens", "revoke", "oncall")
    assert again.returncode == 0 and "already was" in again.stdout
    gone = pulse(stack, "nodes", "list", token=secret)
    assert gone.returncode != 0 and "401" in gone.stderr
    bad = pulse(stack, "tokens", "create", "--name", "env", "--role", "admin")
    assert bad.returncode != 0 and "422" in bad.stderr and "reserved" in bad.stderr
