"""Python models: ``<version>/model.py`` defining ``TritonPythonModel``, as in Triton.

Where it runs: in the server process, on the instance's own worker thread (no
IPC, no copies; the GIL is the limit, so CPU-heavy Python code scales with
numpy/Pillow releasing the GIL, not with instance count). The price is
isolation: user code shares the process. Exceptions are contained (they fail
their batch with INTERNAL, reason BACKEND, and the next batch runs normally).
A hang is bounded by the ``execute_timeout_s`` parameter: ``execute`` then runs
on a watchdog thread and the batch fails with UNAVAILABLE once the time is up;
until the abandoned call returns, further batches fail fast with UNAVAILABLE
instead of touching the model object from two threads. A crash of the
interpreter itself (a segfault in an extension) is not contained.

The model declares its tensors in its config (there is no graph to read). Each
instance imports ``model.py`` and the helpers beside it in a namespace of its own
(:mod:`appliance.backends.python_imports`): two models' ``utils.py`` never collide, and a new
version runs its own helpers after a hot swap.

Triton compatibility: ``import triton_python_backend_utils as pb_utils`` resolves
to :mod:`appliance.python_model`; BLS calls from ``execute`` go through the
server's data plane (:mod:`appliance.bls`); ``async def execute`` runs on an event
loop of the instance's own; a decoupled model (``model_transaction_policy {
decoupled: true }``) answers through ``request.get_response_sender()`` into the
request's :class:`~appliance.decoupled.ResponseStream`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
from types import ModuleType
from typing import Any

import numpy as np

from appliance import bls, decoupled
from appliance import python_model as pb
from appliance.backends import python_autocomplete
from appliance.backends.base import BackendOptions, TensorSpec, check_inputs
from appliance.backends.python_imports import Namespace
from appliance.config.fields import ConfigError
from appliance.errors import ApplianceError, FailureReason, internal, invalid, unavailable


def _load_module(options: BackendOptions, namespace: Namespace) -> ModuleType:
    """``model.py`` imported in the instance's own namespace (its helpers beside it
    are private to it: :mod:`appliance.backends.python_imports`)."""
    # Triton's name for the utilities: a Triton repository's model.py imports it as is
    sys.modules.setdefault("triton_python_backend_utils", pb)
    try:
        return namespace.load(options.model_path)
    except FileNotFoundError:
        raise invalid(f"model '{options.model_name}': cannot import {options.model_path}") from None


def _as_error(model: str, error: BaseException) -> ApplianceError:
    if isinstance(error, ApplianceError):
        return error
    if isinstance(error, pb.TritonError):
        if error.code() == pb.TritonError.INVALID_ARG:
            return invalid(f"model '{model}': {error.message()}")
        if error.code() == pb.TritonError.UNAVAILABLE:
            return unavailable(f"model '{model}': {error.message()}", FailureReason.BACKEND)
        return internal(f"model '{model}': {error.message()}", FailureReason.BACKEND)
    return internal(
        f"model '{model}' raised {type(error).__name__}: {error}", FailureReason.BACKEND
    )


class PythonBackend:
    """One ``TritonPythonModel`` object; see the module docstring for the contract."""

    # a request's parameters and cancel flag travel with its inputs (``RequestInputs``)
    request_context = True

    def __init__(self, options: BackendOptions) -> None:
        self._name = options.model_name
        self.inputs: list[TensorSpec] = list(options.inputs)
        self.outputs: list[TensorSpec] = list(options.outputs)
        timeout = options.parameters.get("execute_timeout_s", "")
        try:
            self._timeout = float(timeout) if timeout else None
        except ValueError:
            raise ConfigError(
                options.config_source,
                "parameters.execute_timeout_s",
                f"expected a number of seconds, got {timeout!r}",
            ) from None
        self._busy: threading.Thread | None = None  # an abandoned, timed-out execute
        config = json.loads(options.model_config or "{}")
        self._decoupled = pb.using_decoupled_model_transaction_policy(config)
        self._loop: asyncio.AbstractEventLoop | None = None  # for ``async def execute``
        self._bls = bls.lookup(options.model_path.parent.parent.parent)
        bls.bind_thread(self._bls, self._name)
        self._namespace = Namespace(options.model_path.parent)
        try:
            self._model = self._start(options)
        except BaseException:
            self._namespace.close()
            raise

    def _start(self, options: BackendOptions) -> Any:
        """Import ``model.py``, make its ``TritonPythonModel`` and initialize it."""
        module = _load_module(options, self._namespace)
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise invalid(
                f"model '{self._name}': {options.model_path} defines no TritonPythonModel"
            )
        if not self.inputs or not self.outputs:
            self._declare(cls, options)
        model = cls()
        init = getattr(model, "initialize", None)
        if init is not None:
            init(
                {
                    "model_config": options.model_config or "{}",
                    "model_instance_kind": options.kind.removeprefix("KIND_"),
                    "model_instance_name": f"{self._name}_{options.instance_index}",
                    "model_instance_device_id": "0",
                    "model_repository": str(options.model_path.parent.parent),
                    "model_version": options.model_path.parent.name,
                    "model_name": self._name,
                }
            )
        return model

    def _declare(self, cls: Any, options: BackendOptions) -> None:
        """Tensors the config leaves out: from the model's ``auto_complete_config``
        (Triton's), or a config error naming what to declare."""
        if hasattr(cls, "auto_complete_config"):
            inputs, outputs = python_autocomplete.complete(
                cls, json.loads(options.model_config or "{}")
            )
            self.inputs = self.inputs or inputs
            self.outputs = self.outputs or outputs
        if not self.inputs or not self.outputs:
            raise ConfigError(
                options.config_source or str(options.model_path.parent.parent),
                "input" if not self.inputs else "output",
                "a Python model has no graph to read its tensors from: declare every "
                "input and output in its config (or in its auto_complete_config)",
            )

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        check_inputs(self._name, self.inputs, inputs)
        bls.bind_thread(self._bls, self._name)
        tensors = [pb.Tensor(n, a) for n, a in inputs.items()]
        if self._decoupled:
            return self._infer_decoupled(tensors, outputs, inputs)
        sent: list[pb.InferenceResponse | None] = []
        # a regular model may answer through the sender too: one response, final
        sender = pb.InferenceResponseSender(
            lambda response, _final: sent.append(response), decoupled=False
        )
        request = self._request(tensors, outputs, inputs, sender)
        responses = self._execute([request])
        if responses is None and sent:
            responses = sent[:1]
        if not isinstance(responses, list) or len(responses) != 1 or responses[0] is None:
            raise internal(
                f"model '{self._name}': execute must return one InferenceResponse per request",
                FailureReason.BACKEND,
            )
        response = responses[0]
        error = response.error()
        if error is not None:
            raise _as_error(self._name, error)
        result = {t.name(): t.as_numpy() for t in response.output_tensors()}
        return {n: result[n] for n in outputs if n in result}

    def _request(
        self,
        tensors: list[pb.Tensor],
        outputs: list[str],
        inputs: dict[str, np.ndarray],
        sender: pb.InferenceResponseSender,
    ) -> pb.InferenceRequest:
        """The request ``execute`` sees, with the parameters and the cancel flag that
        travel with ``inputs`` (:class:`appliance.decoupled.RequestInputs`)."""
        request = pb.InferenceRequest(
            tensors,
            outputs,
            model_name=self._name,
            response_sender=sender,
            parameters=json.dumps(decoupled.parameters_of(inputs)),
        )
        flag = decoupled.cancel_of(inputs)
        if flag is not None:
            request._cancelled = flag.is_set
        return request

    def _infer_decoupled(
        self, tensors: list[pb.Tensor], outputs: list[str], stream_inputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Run ``execute`` for one request whose responses go to its stream; what this
        returns is a placeholder (every response travelled through the stream)."""
        stream = decoupled.stream_of(stream_inputs, self._name)

        def deliver(response: pb.InferenceResponse | None, final: bool) -> None:
            if response is None:
                stream.put(None, final)
                return
            error = response.error()
            if error is not None:
                stream.put(_as_error(self._name, error), final)
                return
            result = {t.name(): t.as_numpy() for t in response.output_tensors()}
            wanted = outputs or list(result)
            stream.put({n: result[n] for n in wanted if n in result}, final)

        sender = pb.InferenceResponseSender(deliver, lambda: stream.cancelled)
        request = self._request(tensors, outputs, stream_inputs, sender)
        try:
            returned = self._execute([request])
        except ApplianceError as exc:
            stream.fail(exc)
            raise
        if returned is not None and any(r is not None for r in returned):
            stream.fail(
                internal(
                    f"decoupled model '{self._name}': execute must return None and answer "
                    "through the response sender",
                    FailureReason.BACKEND,
                )
            )
        return {n: np.empty(0) for n in outputs}

    def _call_execute(self, requests: list[pb.InferenceRequest]) -> Any:
        """``execute``, run to completion on this thread's own loop when it is async."""
        result = self._model.execute(requests)
        if inspect.iscoroutine(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            bls.bind_thread(self._bls, self._name)  # also for a watchdog thread
            return self._loop.run_until_complete(result)
        return result

    def _execute(self, requests: list[pb.InferenceRequest]) -> Any:
        if self._timeout is None:
            try:
                return self._call_execute(requests)
            except Exception as exc:
                raise _as_error(self._name, exc) from None
        if self._busy is not None and self._busy.is_alive():
            raise unavailable(
                f"model '{self._name}' is still running an execute that timed out",
                FailureReason.BACKEND,
            )
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                bls.bind_thread(self._bls, self._name)
                box["result"] = self._call_execute(requests)
            except BaseException as exc:  # handed to the waiting instance thread
                box["error"] = exc

        # daemon: a call that never returns must not keep the process from exiting
        worker = threading.Thread(target=call, name=f"{self._name}-execute", daemon=True)
        worker.start()
        worker.join(self._timeout)
        if worker.is_alive():
            self._busy = worker
            raise unavailable(
                f"model '{self._name}': execute did not finish within {self._timeout:g}s",
                FailureReason.BACKEND,
            )
        if "error" in box:
            raise _as_error(self._name, box["error"])
        return box["result"]

    def close(self) -> None:
        try:
            finalize = getattr(self._model, "finalize", None)
            if finalize is not None and (self._busy is None or not self._busy.is_alive()):
                finalize()
        finally:
            if self._loop is not None:
                self._loop.close()
            self._namespace.close()
