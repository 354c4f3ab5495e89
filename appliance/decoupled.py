"""Decoupled models: 0..N responses per request (Triton's ``model_transaction_policy
{ decoupled: true }``).

A decoupled request travels the usual path (validation, queue, instance thread),
one request per execution. Its inputs are a :class:`RequestInputs`, a dict that
also carries the request's :class:`ResponseStream`; the batcher hands a lone
request's inputs dict to the backend as is (no copy), so the Python backend finds
the stream there and gives the model a response sender bound to it.

Concurrency contract: :meth:`ResponseStream.put` may be called from any thread
(the model may answer from threads of its own, after ``execute`` returned); each
item is handed to the event loop with ``call_soon_threadsafe`` and only the loop
touches the queue. The consumer iterates until the final item; if the execution
fails before the final response, :meth:`ResponseStream.fail` ends the stream
with that error. Items put after the final one are dropped with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import numpy as np

from appliance.errors import ApplianceError, internal

log = logging.getLogger(__name__)

# one response: its outputs, or the error the model sent instead
Item = dict[str, np.ndarray] | ApplianceError


class ResponseStream:
    """Responses of one decoupled request, from the model's threads to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, model: str) -> None:
        self._loop = loop
        self._model = model
        self._queue: asyncio.Queue[tuple[Item | None, bool]] = asyncio.Queue()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, item: Item | None, final: bool) -> None:
        """Deliver one response (``None``: only the final flag). Thread-safe."""
        with self._lock:
            if self._closed:
                log.warning("model '%s' sent a response after its final one", self._model)
                return
            self._closed = final
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (item, final))

    def fail(self, error: ApplianceError) -> None:
        """End the stream with ``error`` unless the model already sent its final one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (error, True))

    async def __aiter__(self) -> AsyncIterator[tuple[Item | None, bool]]:
        while True:
            item, final = await self._queue.get()
            yield item, final
            if final:
                return


class RequestInputs(dict[str, np.ndarray]):
    """A request's inputs plus the stream its responses go to."""

    def __init__(self, inputs: dict[str, np.ndarray], stream: ResponseStream) -> None:
        super().__init__(inputs)
        self.stream = stream


def stream_of(inputs: dict[str, np.ndarray], model: str) -> ResponseStream:
    """The stream a decoupled execution answers to; INTERNAL when the inputs lost it
    (which only happens if requests were batched together)."""
    stream = getattr(inputs, "stream", None)
    if not isinstance(stream, ResponseStream):
        raise internal(f"decoupled model '{model}' was called without a response stream")
    return stream
