"""Schemathesis from outside, as a client would run it: the ``st run`` command line with every
check (``--checks all``, and ``max_response_time`` at a generous bound) against a live
``pulse orchestrator`` process on PostgreSQL, over HTTP. All four phases run: the schema's
examples, coverage (boundary values, missing headers, unsupported methods and ``Allow``),
fuzzing, and stateful sequences (``use_after_free``, ``ensure_resource_availability``).

The orchestrator runs in development mode with a bootstrap token, the mode the findings of
issue #20 item 7 came from: reads, /metrics and probes open, mutations behind a token. The
schema says so (services/api/openapi.py ``document``), so ``ignored_auth`` holds the app to it. It
runs twice: with the bootstrap token, and without any (every mutation then a 401, issue #37).
Path parameters name things that exist (a HEALTHY node, a job placed on it), so that 404 does
not hide the handlers. Rate limiting is off (429s would hide handlers; tests/integration/
test_ratelimit.py covers it) where a token is sent; without one it is on, and every mutation
must still be a 401 (who are you before how often). tests/integration/test_schemathesis.py runs in process with
every route protected; this one checks the process a user talks to.

Bounded: ``EXAMPLES`` per operation (``PULSE_SCHEMATHESIS_LIVE_EXAMPLES``, default 40; the run that
found issue #20's findings used 60) and a fixed seed (``PULSE_SCHEMATHESIS_SEED``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import AUTH, NODE, TOKEN, live_orchestrator
from tests.support import fresh_database, http

pytestmark = pytest.mark.timeout(300)

EXAMPLES = int(os.environ.get("PULSE_SCHEMATHESIS_LIVE_EXAMPLES", "40"))
SEED = int(os.environ.get("PULSE_SCHEMATHESIS_SEED", "20"))
ST = Path(sys.executable).with_name("st")

# A body over PULSE_MAX_BODY_BYTES is refused with 413 before it is read: a rejection too.
CONFIG = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]

[parameters]
"path.name" = "{node}"
"path.job_id" = "{job}"
"""


@pytest.mark.parametrize("caller", ["token", "no-token"])
def test_schemathesis_with_every_check_against_a_live_orchestrator_on_postgresql(tmp_path: Path, caller: str) -> None:
    # Without a token the rate limit is on, its burst small enough to be spent: every mutation is still a 401.
    limits = {} if caller == "token" else {"PULSE_RATE_LIMIT_PER_S": "1", "PULSE_RATE_LIMIT_BURST": "3"}
    with fresh_database("postgresql", tmp_path) as url, live_orchestrator(tmp_path, url, gpus=64, **limits) as stack:
        job = http().post(
            f"{stack.api}/v1/jobs",
            json={"name": "st", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["x.py"]},
            headers=AUTH,
            timeout=30,
        )
        assert job.status_code == 201, job.text
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG.format(node=NODE, job=job.json()["id"]))
        command = [
            str(ST),
            "--config-file", str(config),
            "run", f"{stack.api}/openapi.json",
            "--checks", "all",
            "--max-response-time", "30",
            # without a token every mutation is a 401 and the reads are the token run's: a quarter
            "--max-examples", str(EXAMPLES if caller == "token" else max(1, EXAMPLES // 4)),
            "--seed", str(SEED),
            # One worker: schemathesis's workers are threads, and CPython 3.11.7 (this machine's)
            # counts the AST constructor's recursion depth in state the threads share, so two
            # threads compiling at once fail with "SystemError: AST constructor recursion depth
            # mismatch" (python/cpython#106905; a clean-clone CI run hit it once).
            "--workers", "1",
            *(["--header", f"Authorization: Bearer {TOKEN}"] if caller == "token" else []),
            "--generation-database", "none",
            "--request-timeout", "60",
            "--no-color",
            "--exclude-path", "/v1/stream",  # endless (Server-Sent Events): tests/e2e/test_stream.py
        ]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
        out = run.stdout + run.stderr
        shown = "\n".join(line[:400] for line in out.splitlines())  # a fuzzed body can run to megabytes
        assert run.returncode == 0, shown[-20000:] + "\n--- orchestrator\n" + stack.logs()[-3000:]
        selected = re.search(r"Selected: (\d+)/", out)
        assert selected and f"Tested: {selected[1]}" in out, out[-5000:]  # every operation, not one skipped
        assert "failures" not in out.rsplit("SUMMARY", 1)[-1].lower(), out[-5000:]
        print(out.rsplit("SUMMARY", 1)[-1])
