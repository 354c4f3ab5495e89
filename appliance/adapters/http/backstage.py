"""The aiohttp application behind an HTTP front, made on first need (:class:`Backstage`).

:mod:`appliance.adapters.http.front` answers inference and the read-only KServe routes
itself; only the other routes (repository control, statistics, shared memory, the
generate, OpenAI and detection APIs, anything unusual) go to aiohttp. A server that
only ever sees the first kind never imports aiohttp at all: its start-up and idle
memory are spared aiohttp's imports (its client, and the system's CA certificates it
loads on import). The first connection handed over waits while aiohttp and the
routes' modules are imported on a worker thread (the event loop keeps serving), then
the application is built and set up on the loop, once; later hand-overs are
immediate.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

# what the application's routes import: loaded off the loop before it is built
MODULES = (
    "aiohttp.web",
    "appliance.adapters.http.api",
    "appliance.adapters.http.vision",
)


def _import_all() -> None:
    for name in MODULES:
        importlib.import_module(name)


class Backstage:
    """The aiohttp runner behind a front; ``make`` builds and sets it up (on the loop,
    once its modules are imported)."""

    def __init__(self, make: Callable[[], Awaitable[web.AppRunner]]) -> None:
        self._make = make
        self.runner: web.AppRunner | None = None
        self._starting: asyncio.Future[web.AppRunner] | None = None

    @property
    def server(self) -> web.Server | None:
        """aiohttp's request handler factory, once the runner is set up."""
        return None if self.runner is None else self.runner.server

    async def start(self) -> web.Server:
        """The runner's handler factory, made once (concurrent callers share the one
        attempt; a failed attempt is tried again by the next caller)."""
        starting = self._starting
        if starting is None or (starting.done() and (starting.cancelled() or starting.exception())):
            starting = self._starting = asyncio.ensure_future(self._start())
        runner = await asyncio.shield(starting)
        assert runner.server is not None
        return runner.server

    async def _start(self) -> web.AppRunner:
        await asyncio.to_thread(_import_all)
        runner = await self._make()
        self.runner = runner
        log.debug("aiohttp application set up for the routes the front hands over")
        return runner

    async def cleanup(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()
