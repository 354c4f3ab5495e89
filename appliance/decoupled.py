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

Cancellation: when the caller goes away (a closed stream, a client that left),
the data plane calls :meth:`ResponseStream.cancel` on the loop; a model sees it in
:attr:`ResponseStream.cancelled` (any thread) and through the callbacks it
registered with :meth:`ResponseStream.on_cancel` (run on the loop, once).

Tokens: a model that generates text reports each new token with
:meth:`ResponseStream.count_tokens` (one thread, the model's); the stream's
:class:`TokenMeter` keeps when the first one came and the gaps between them, which
the data plane turns into time-to-first-token and inter-token statistics once the
stream ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from appliance.errors import ApplianceError, internal

log = logging.getLogger(__name__)

# one response: its outputs, or the error the model sent instead
Item = dict[str, np.ndarray] | ApplianceError


class TokenMeter:
    """When one request's tokens came: written by the model's one thread, read by
    the loop after the final response (which the same thread put after its last
    count, so the loop sees every count)."""

    __slots__ = ("first_ns", "gaps_ns", "input_tokens", "last_ns", "output_tokens", "start_ns")

    def __init__(self) -> None:
        self.start_ns = time.perf_counter_ns()
        self.first_ns = 0  # 0: no token yet
        self.last_ns = 0
        self.input_tokens = 0
        self.output_tokens = 0
        # the gap before each token after the first, in ns; ``count`` tokens that come
        # together share their gap equally
        self.gaps_ns: list[int] = []

    def count(self, new_tokens: int, input_tokens: int) -> None:
        if new_tokens <= 0:
            return
        now = time.perf_counter_ns()
        self.input_tokens = input_tokens
        self.output_tokens += new_tokens
        if not self.first_ns:  # the first token; any that came with it: no gap
            self.first_ns = now
            self.gaps_ns.extend([0] * (new_tokens - 1))
        else:
            self.gaps_ns.extend([(now - self.last_ns) // new_tokens] * new_tokens)
        self.last_ns = now


class ResponseStream:
    """Responses of one decoupled request, from the model's threads to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, model: str) -> None:
        self._loop = loop
        self._model = model
        self._queue: asyncio.Queue[tuple[Item | None, bool]] = asyncio.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        self.meter = TokenMeter()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop if the caller goes away (at once if it did).
        Thread-safe."""
        with self._lock:
            if not self.cancelled:
                self._on_cancel.append(callback)
                return
        self._loop.call_soon_threadsafe(callback)

    def cancel(self) -> None:
        """The caller went away: mark the stream cancelled and tell the model (on
        the loop; a no-op once the final response was sent)."""
        with self._lock:
            if self.cancelled or self._closed:
                return
            self.cancelled = True
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a model's callback must not break the caller's cleanup
                log.exception("model '%s': a cancel callback failed", self._model)

    def count_tokens(self, new_tokens: int, input_tokens: int) -> None:
        """``new_tokens`` were generated just now for a prompt of ``input_tokens``."""
        self.meter.count(new_tokens, input_tokens)

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


class CancelFlag:
    """Whether the caller of one request (or of every request of a batch) went away;
    set on the event loop, read from any thread (the model's ``is_cancelled()``)."""

    __slots__ = ("_parts", "_set")

    def __init__(self, parts: tuple[CancelFlag, ...] = ()) -> None:
        self._set = False
        self._parts = parts

    @classmethod
    def all_of(cls, flags: list[CancelFlag]) -> CancelFlag:
        """A batch's flag: set once every request in it was cancelled."""
        return cls(tuple(flags))

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        if self._parts:
            return all(p.is_set() for p in self._parts)
        return self._set


class RequestInputs(dict[str, np.ndarray]):
    """A request's inputs plus what travels with them to the model: the stream a
    decoupled model answers to (None for a regular model), the request's own
    parameters (Triton's ``request.parameters()``) and its cancel flag."""

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        stream: ResponseStream | None,
        parameters: dict[str, str | int | float | bool] | None = None,
        cancel: CancelFlag | None = None,
    ) -> None:
        super().__init__(inputs)
        self.stream = stream
        self.parameters = parameters or {}
        self.cancel = cancel or CancelFlag()


def parameters_of(inputs: dict[str, np.ndarray]) -> dict[str, str | int | float | bool]:
    """The request parameters that travel with a request's inputs."""
    found = getattr(inputs, "parameters", None)
    return found if isinstance(found, dict) else {}


def cancel_of(inputs: dict[str, np.ndarray]) -> CancelFlag | None:
    """The cancel flag that travels with a request's inputs, if any."""
    found = getattr(inputs, "cancel", None)
    return found if isinstance(found, CancelFlag) else None


def with_context(
    inputs: dict[str, np.ndarray], parameters: dict[str, str | int | float | bool]
) -> RequestInputs:
    """``inputs`` as a :class:`RequestInputs` (as they are when they already are one)."""
    if isinstance(inputs, RequestInputs):
        return inputs
    return RequestInputs(inputs, None, parameters)


def stream_of(inputs: dict[str, np.ndarray], model: str) -> ResponseStream:
    """The stream a decoupled execution answers to; INTERNAL when the inputs lost it
    (which only happens if requests were batched together)."""
    stream = getattr(inputs, "stream", None)
    if not isinstance(stream, ResponseStream):
        raise internal(f"decoupled model '{model}' was called without a response stream")
    return stream


def joined(responses: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A decoupled model's responses as one: each BYTES output of one element (text,
    a language model's tokens) joined over the responses, every other output as the
    last response that had it sent it."""
    parts: dict[str, list[bytes]] = {}
    last: dict[str, np.ndarray] = {}
    for outputs in responses:
        for name, arr in outputs.items():
            if arr.dtype == np.object_ and arr.size == 1:
                value = arr.reshape(-1)[0]
                parts.setdefault(name, []).append(
                    value if isinstance(value, bytes) else str(value).encode()
                )
            last[name] = arr
    for name, pieces in parts.items():
        last[name] = np.array([b"".join(pieces)], dtype=np.object_).reshape(last[name].shape)
    return last
