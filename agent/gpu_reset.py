"""A GPU reset on this node, as ``POST /v1/nodes/{name}/gpus/{index}/reset`` asks (a ``reset``
command on the node's stream, ``wire.JobCommand``): ``PULSE_GPU_RESET_COMMAND`` with the GPU's
index (``nvidia-smi --gpu-reset -i {index}`` by default; it refuses while a process has the GPU
open), or on a simulated node, :meth:`agent.simulated.SimulatedNode.reset`. The orchestrator has
checked that no rank of a running job drives the GPU (services/health/gpu_reset.py); whether the
reset cleared the fault, the GPU's next heartbeats say."""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

from clusterpulse import wire

log = logging.getLogger("pulse.agent.launcher")

Reset = Callable[[int], str]
"""Reset GPU ``index``; returns what the reset said, raises ``ResetFailed`` naming why not."""


class ResetFailed(Exception):
    pass


def command_reset(template: str, *, timeout_s: float = 120.0) -> Reset:
    """A :data:`Reset` that runs ``template`` with ``{index}`` filled in (no shell)."""

    def reset(index: int) -> str:
        argv = shlex.split(template.format(index=index))
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ResetFailed(f"{shlex.join(argv)}: {exc}") from exc
        said = (done.stdout + done.stderr).strip()[-2000:]
        if done.returncode != 0:
            raise ResetFailed(f"{shlex.join(argv)} exited {done.returncode}: {said}")
        return said

    return reset


async def handle_reset(cmd: wire.JobCommand, *, node: str, state_dir: Path, reset: Reset | None) -> bool:
    """A ``reset`` command (the node's launcher hands it here), once per request id: a command read
    again after a restart resets nothing twice. True when the reset ran and succeeded."""
    done = state_dir / "resets"
    seen = done.read_text().split() if done.exists() else []
    if not cmd.gpus or cmd.request in seen:
        log.info("event=gpu_reset_skipped node=%s request=%s gpus=%s", node, cmd.request, cmd.gpus)
        return False
    done.write_text("\n".join([*seen[-99:], cmd.request]) + "\n")  # before: a crash mid-reset does not repeat it
    index = cmd.gpus[0]
    if reset is None:
        log.error("event=gpu_reset_failed node=%s gpu=%d request=%s error=%r", node, index, cmd.request,
                  "this agent resets no GPU")  # fmt: skip
        return False
    try:
        said = await asyncio.to_thread(reset, index)
    except (ResetFailed, ValueError) as exc:
        log.error("event=gpu_reset_failed node=%s gpu=%d request=%s error=%r", node, index, cmd.request, str(exc))
        return False
    log.warning("event=gpu_reset node=%s gpu=%d request=%s said=%r", node, index, cmd.request, said)
    return True
