"""How the HTTP routes are declared: who may call each (its scope) and, for a route
that speaks another API than KServe, the shape of its errors.

Every refusal the front middleware answers before or around a handler (401/403,
413, 408, a mapped error, a bug's 500) has the shape of the route's API: KServe's
``{"error": message}`` by default, OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` on the OpenAI routes, DeepStack's ``{"success": false, "error", "code"}``
on the detection routes. A client of that API can then read every error it gets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from appliance.adapters.access import Scope

# (status, message) -> the error body of a route's API
Shape = Callable[[int, str], bytes]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Register(Protocol):
    """``get``/``post`` of the app being built: a route, its scope, its error shape."""

    def __call__(
        self,
        path: str,
        handler: Callable[[web.Request], Any],
        scope: Scope,
        shape: Shape | None = None,
    ) -> None: ...
