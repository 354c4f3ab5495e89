"""One request to a decoupled servable, its responses as they come: what the data plane
streams to a caller and what an ensemble reads from a decoupled step.

The request's inputs travel as a :class:`~appliance.decoupled.RequestInputs` carrying
a fresh :class:`~appliance.decoupled.ResponseStream`; the servable's ``infer`` runs as a
task (a Python model's returns once ``execute`` did, an ensemble's once its last
response is in the stream) while the responses are read off the stream. Closing the
iteration early (the caller went away) cancels the task if it still runs and the
stream, which the model sees (``is_cancelled()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from appliance.core.servable import Servable
from appliance.decoupled import Item, RequestInputs, ResponseStream
from appliance.errors import ApplianceError, unavailable
from appliance.request import InferenceRequest


async def responses(
    mv: Servable, request: InferenceRequest, declared: bool = False
) -> AsyncGenerator[tuple[Item | None, bool]]:
    """Each response of ``request`` on ``mv`` (decoupled) with its final flag: outputs
    by the model's names, an error the model sent, or None (the final flag alone)."""
    loop = asyncio.get_running_loop()
    stream = ResponseStream(loop, mv.config.name)
    request.inputs = RequestInputs(request.inputs, stream, request.parameters)
    task = loop.create_task(mv.infer(request, declared))

    def ended(t: asyncio.Task[object]) -> None:
        if not t.cancelled() and t.exception() is not None:
            error = t.exception()
            stream.fail(error if isinstance(error, ApplianceError) else unavailable(str(error)))

    task.add_done_callback(ended)
    finished = False
    try:
        async for item, final in stream:
            finished = final
            yield item, final
    finally:
        if not task.done():
            task.cancel()
        if not finished:  # the caller went away: the model may stop generating
            stream.cancel()
        if stream.meter.output_tokens:
            mv.stats.record_tokens(stream.meter)
