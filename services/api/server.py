"""The orchestrator's HTTP server: uvicorn, told that the app is stopping before it waits.

On SIGTERM uvicorn stops accepting, then waits for every open response before the app's lifespan
ends, and an event stream (``GET /v1/stream``: the status page, ``pulse events --follow``) never
ends by itself: an orchestrator with one viewer never stopped, so its loops, its last outbox and
the release of its lease waited for a SIGKILL, and a follower for the lease to run out.
:class:`Server` sets ``app.state.stopping`` first, which ends every stream (its client reconnects
with ``Last-Event-ID``), and cancels what still runs after ``PULSE_SHUTDOWN_GRACE_S``."""

from __future__ import annotations

import math
import socket

import uvicorn
from fastapi import FastAPI

from clusterpulse.settings import Settings


class Server(uvicorn.Server):
    """uvicorn's server, which sets the app's ``stopping`` event (made by its lifespan; routes take
    it as ``StoppingDep``) before it waits for open responses. uvicorn calls :meth:`shutdown` only
    after the lifespan started."""

    def __init__(self, app: FastAPI, settings: Settings, *, host: str, port: int) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=max(1, math.ceil(settings.shutdown_grace_s)),  # whole seconds
        )  # fmt: skip
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._app.state.stopping.set()
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: Settings, *, host: str, port: int) -> None:
    """Run ``app`` until SIGTERM or SIGINT (``pulse orchestrator``)."""
    Server(app, settings, host=host, port=port).run()
