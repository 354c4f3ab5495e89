"""Business-logic scripting (BLS): a Python model calling other loaded models.

Triton's ``pb_utils.InferenceRequest(...).exec()`` runs a model from inside a
Python model's ``execute``. Here a call goes through the server's data plane like
any client request (validation, queueing, batching, statistics), without sockets.

Who runs where: ``execute`` runs on its instance's worker thread; :func:`call`
hands the request to the server's event loop with ``run_coroutine_threadsafe``
and blocks that worker thread (never the loop) until the answer comes. The loop
stays free, so the called model is batched and run by its own instances as
usual. A model calling itself could wait for its own instance: that call is
refused up front (INVALID_ARG) instead of hanging.
:func:`call_async` is the same call as an awaitable, for ``async def execute``.

Binding: the server registers its data plane here for its model repository when
it starts (:func:`register`) and removes it when it stops. A Python backend looks
its server up by repository; where that fails (a model built outside a server)
the most recently registered server is used.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appliance.errors import ApplianceError, invalid, unavailable
from appliance.request import InferenceRequest, InferenceResponse


class Executor(Protocol):
    """What BLS needs of the data plane."""

    async def infer(self, request: InferenceRequest) -> InferenceResponse: ...

    def infer_stream(
        self, request: InferenceRequest
    ) -> AsyncIterator[tuple[InferenceResponse | ApplianceError, bool]]: ...


@dataclass(frozen=True, slots=True)
class Binding:
    loop: asyncio.AbstractEventLoop
    executor: Executor


_lock = threading.Lock()
_by_repository: dict[Path, list[Binding]] = {}
_order: list[Binding] = []


def register(repository: Path, loop: asyncio.AbstractEventLoop, executor: Executor) -> Binding:
    binding = Binding(loop, executor)
    with _lock:
        _by_repository.setdefault(repository.resolve(), []).append(binding)
        _order.append(binding)
    return binding


def unregister(repository: Path, binding: Binding) -> None:
    with _lock:
        bindings = _by_repository.get(repository.resolve(), [])
        if binding in bindings:
            bindings.remove(binding)
        if binding in _order:
            _order.remove(binding)


def lookup(repository: Path | None) -> Binding | None:
    """The server serving ``repository`` (the newest one registered), else the most
    recently registered server, else None."""
    with _lock:
        if repository is not None:
            bindings = _by_repository.get(repository.resolve())
            if bindings:
                return bindings[-1]
        return _order[-1] if _order else None


_current = threading.local()  # the binding of the model whose execute runs on this thread


def bind_thread(binding: Binding | None, model: str = "") -> None:
    """Set the binding BLS calls made on this thread use, and the calling model (the
    Python backend does it on its instance thread before ``initialize``/``execute``)."""
    _current.binding = binding
    _current.model = model


def _binding() -> Binding:
    binding: Binding | None = getattr(_current, "binding", None) or lookup(None)
    if binding is None:
        raise unavailable("BLS: no running server to send the request to")
    return binding


def _check_thread(binding: Binding, request: InferenceRequest) -> None:
    if request.model_name and request.model_name == getattr(_current, "model", ""):
        raise invalid(
            f"BLS: model '{request.model_name}' cannot call itself: its instance would "
            "wait for itself"
        )
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is binding.loop:
        raise invalid(
            "BLS: exec() was called on the server's event loop thread, where waiting for "
            "the answer would stop the server; call it from execute()"
        )


def call(request: InferenceRequest, timeout_s: float | None = None) -> InferenceResponse:
    """Run ``request`` through the data plane and wait (blocking this thread)."""
    binding = _binding()
    _check_thread(binding, request)
    future: Future[InferenceResponse] = asyncio.run_coroutine_threadsafe(
        binding.executor.infer(request), binding.loop
    )
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise unavailable(f"BLS: model '{request.model_name}' did not answer in time") from None


async def call_async(request: InferenceRequest) -> InferenceResponse:
    """:func:`call` as an awaitable on the caller's own event loop."""
    binding = _binding()
    _check_thread(binding, request)
    future = asyncio.run_coroutine_threadsafe(binding.executor.infer(request), binding.loop)
    return await asyncio.wrap_future(future)


def call_stream(
    request: InferenceRequest, timeout_s: float | None = None
) -> Generator[InferenceResponse | ApplianceError]:
    """Run a (decoupled) model and yield its responses as they come (blocking); an
    error the model sent comes as an :class:`ApplianceError` item."""
    binding = _binding()
    _check_thread(binding, request)
    results: list[tuple[InferenceResponse | ApplianceError, bool]] = []
    ready = threading.Condition()

    async def pump() -> None:
        try:
            async for item in binding.executor.infer_stream(request):
                with ready:
                    results.append(item)
                    ready.notify()
        except ApplianceError as exc:
            with ready:
                results.append((exc, True))
                ready.notify()

    future = asyncio.run_coroutine_threadsafe(pump(), binding.loop)

    def wake(_: object) -> None:  # a pump that ended without a final item
        with ready:
            ready.notify_all()

    future.add_done_callback(wake)
    taken = 0

    def more() -> bool:
        return len(results) > taken or future.done()

    try:
        while True:
            with ready:
                if not ready.wait_for(more, timeout_s):
                    raise unavailable(f"BLS: model '{request.model_name}' did not answer in time")
                batch = results[taken:]
            taken += len(batch)
            for item, final in batch:
                yield item  # as Triton: the final response may be empty, and is yielded too
                if final:
                    return
            if future.done() and taken == len(results):
                future.result()  # re-raise a failure of the pump itself
                return
    finally:
        # the caller stopped reading early (or timed out): the called model's request
        # is cancelled, which it sees
        future.cancel()


async def call_stream_async(
    request: InferenceRequest,
) -> AsyncIterator[InferenceResponse | ApplianceError]:
    """:func:`call_stream` on the caller's own event loop (``async_exec(decoupled=True)``)."""
    binding = _binding()
    _check_thread(binding, request)
    items: asyncio.Queue[tuple[InferenceResponse | ApplianceError, bool]] = asyncio.Queue()
    caller = asyncio.get_running_loop()

    async def pump() -> None:
        try:
            async for item in binding.executor.infer_stream(request):
                caller.call_soon_threadsafe(items.put_nowait, item)
        except ApplianceError as exc:
            caller.call_soon_threadsafe(items.put_nowait, (exc, True))

    future = asyncio.run_coroutine_threadsafe(pump(), binding.loop)
    future.add_done_callback(
        lambda f: (
            f.cancelled()
            or f.exception() is None
            or caller.call_soon_threadsafe(
                items.put_nowait, (unavailable(f"BLS: {f.exception()}"), True)
            )
        )
    )
    try:
        while True:
            item, final = await items.get()
            yield item
            if final:
                return
    finally:
        future.cancel()
