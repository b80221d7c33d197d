"""Running the app under uvicorn, with graceful shutdown.

On SIGTERM or SIGINT uvicorn stops accepting connections and lets in-flight responses finish; after
`serve.shutdown_timeout_s` what is left is cancelled: its stream ends with an error event, its KV blocks
are freed. A shutdown we were asked for is a clean exit (status 0); a start-up failure exits with its
message (status 2).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from unified.errors import UserError
from unified.serve.app import create_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal it caught so the process dies of it; for us a requested
            # shutdown that completed is a normal exit.
            self._captured_signals.clear()


async def _supervise(server: _Server, startup, deadline: float) -> None:
    """Stops the server if start-up fails; at the shutdown deadline, ends what is still in flight."""
    while not (startup.ready or startup.phase == "failed" or server.should_exit):
        await asyncio.sleep(0.2)
    if startup.phase == "failed":
        server.should_exit = True
        return
    while not server.should_exit:
        await asyncio.sleep(0.2)
    await asyncio.sleep(deadline)
    if startup.loop is not None and startup.loop.num_in_flight:
        log.warning("shutdown deadline reached: cancelling %d in-flight requests", startup.loop.num_in_flight)
        startup.loop.cancel_all("the server shut down before this request finished; retry on another replica")


def serve(cfg) -> None:
    app = create_app(cfg)
    deadline = cfg.serve.shutdown_timeout_s
    # uvicorn's own limit comes a little later, so cancelled streams can still send their last event.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=deadline + 3, lifespan="on")
    server = _Server(config)
    startup = app.state.server.startup

    async def main() -> None:
        watcher = asyncio.create_task(_supervise(server, startup, deadline))
        try:
            await server.serve()
        finally:
            watcher.cancel()

    asyncio.run(main())
    if startup.phase == "failed":
        raise UserError(f"the server could not start: {startup.message}")
    if not server.started:
        raise UserError(f"could not listen on {cfg.host}:{cfg.port} (is the port in use?); pick another with port=")
