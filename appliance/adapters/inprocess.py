"""The in-process API: the appliance inside a Python camera application, no sockets.

Same model repository, batching, instance groups, errors and statistics as over
the wire, because it is the same data plane; only the protocol adapter differs::

    from appliance import InProcessServer

    async with InProcessServer("models") as server:          # inside asyncio
        out = await server.infer("detector", {"images": frames})

    with InProcessServer("models") as server:                # plain threads
        out = server.infer_blocking("detector", {"images": frames})

Arrays are passed by reference (never copied on the way in); outputs of a
batched request are views of the batch result. Errors are ``ApplianceError``
with the same codes and messages HTTP and gRPC callers see.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from appliance import datatypes
from appliance.adapters import exchange
from appliance.adapters.request_form import ARRAY, OutputFormat, RequestForm, TensorForm
from appliance.config.server_config import load_server_config
from appliance.core.admission import Ticket
from appliance.errors import ApplianceError, Code
from appliance.request import InferenceResponse, check_sequence_id
from appliance.server import Server

T = TypeVar("T")


class _ArraysWire(exchange.Wire[dict[str, np.ndarray]]):
    """The in-process wire: the form is built by the caller (arrays by reference), the
    answer is the outputs by name."""

    def read(self, payload: Any, ticket: Ticket | None) -> RequestForm:
        form: RequestForm = payload
        return form

    def encode(
        self, response: InferenceResponse, fmt: OutputFormat, shm: Any
    ) -> dict[str, np.ndarray]:
        return response.outputs


_ARRAYS = _ArraysWire()


def _array(name: str, arr: np.ndarray) -> TensorForm:
    if not isinstance(arr, np.ndarray):
        arr = np.asarray(arr)
    return TensorForm(name, datatypes.from_numpy_dtype(arr.dtype), list(arr.shape), ARRAY, arr)


class InProcessServer:
    """Models served inside this process.

    Use it as an async context manager from asyncio code, or as a plain context
    manager from threaded code: then it runs its own event loop on a background
    thread, and the ``*_blocking`` methods are safe to call from any thread.
    ``stop()`` drains queued requests before the models unload.
    """

    def __init__(self, model_repository: str | Path | None = None, **options: Any) -> None:
        # no endpoints: every port is off unless the caller asks for one explicitly
        for port in ("http_port", "grpc_port", "metrics_port"):
            options.setdefault(port, -1)
        options["model_repository"] = model_repository
        self.server = Server(load_server_config(None, options))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- asyncio use ------------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository; models that fail are reported by :meth:`index`."""
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    async def __aenter__(self) -> InProcessServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str = "",
        outputs: tuple[str, ...] = (),
        timeout_us: int | None = None,
        sequence_id: int | str = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run one request through the model's scheduler; returns its outputs by name.
        ``sequence_*``: Triton's sequence parameters for stateful models."""
        form = RequestForm(
            model,
            version,
            [_array(name, arr) for name, arr in inputs.items()],
            OutputFormat(),
            outputs=outputs,
            timeout_us=timeout_us,
            sequence_id=check_sequence_id(sequence_id),
            sequence_start=sequence_start,
            sequence_end=sequence_end,
        )
        # the one exchange: admitted with the arrays' bytes, each declared, inferred
        dataplane = self.server.dataplane
        ticket = dataplane.admit(model, version, sum(a.nbytes for a in inputs.values()))
        return await exchange.serve(dataplane, _ARRAYS, form, 0, ticket)

    def statistics(self, model: str = "", version: str = "") -> dict[str, Any]:
        """Triton-shaped statistics, as ``GET /v2/models/{m}/stats`` returns them."""
        return self.server.dataplane.statistics(model, version)

    def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        return self.server.dataplane.model_metadata(model, version)

    def index(self) -> list[dict[str, Any]]:
        """Every model version with its state and, for failures, the reason."""
        return self.server.dataplane.repository_index()

    # ---- blocking use (own loop on a background thread) -------------------------------

    def __enter__(self) -> InProcessServer:
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="appliance-inprocess", daemon=True)
        self._thread.start()
        started.wait()
        try:
            self._call(self.start())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self.stop())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            self._loop = self._thread = None

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise ApplianceError(
                Code.UNAVAILABLE, "the in-process server is not running: use it in a with-block"
            )
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def infer_blocking(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str = "",
        outputs: tuple[str, ...] = (),
        timeout_us: int | None = None,
        sequence_id: int | str = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> dict[str, np.ndarray]:
        """:meth:`infer` for threaded code; many threads may call it at once (they batch)."""
        return self._call(
            self.infer(
                model,
                inputs,
                version=version,
                outputs=outputs,
                timeout_us=timeout_us,
                sequence_id=sequence_id,
                sequence_start=sequence_start,
                sequence_end=sequence_end,
            )
        )
