"""The data plane: the one entry every protocol adapter calls.

HTTP, gRPC, MQTT and the in-process API all turn their wire format into an
:class:`InferenceRequest` and call :meth:`DataPlane.infer`; metadata, config,
statistics and repository control live here too, so no adapter holds logic of
its own. Everything raises :class:`ApplianceError`, never a protocol status.

Every model name and version that arrives is checked here first
(:mod:`appliance.names`: INVALID_ARG for a name that is not one path component or
a version that is not a number), so no adapter can route around the rule.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np

from appliance import names
from appliance.config.triton_config import json_to_dict, to_triton_json
from appliance.core import reshape, streaming
from appliance.core.admission import Ticket
from appliance.core.cuda_shared_memory import CudaSharedMemory
from appliance.core.lifecycle import ModelLifeCycle
from appliance.core.log_settings import LogSettings
from appliance.core.queue_bytes import CONTENDED, Hold, QueuedBytes, default_limit, tensor_bytes
from appliance.core.servable import Servable, State
from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.core.trace import Tracer
from appliance.decoupled import joined
from appliance.errors import (
    ApplianceError,
    Code,
    FailureReason,
    internal,
    invalid,
    not_found,
    unavailable,
)
from appliance.request import InferenceRequest, InferenceResponse
from appliance.version import __version__

EXTENSIONS = [
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
    "sequence",
    "trace",
    "logging",
]


def classify(arr: np.ndarray, k: int, batched: bool, labels: tuple[str, ...] = ()) -> np.ndarray:
    """Triton's classification extension: the top-k entries of each batch row as
    BYTES "value:index" strings, highest first ("value:index:label" where the output
    has a ``label_filename``)."""
    rows = arr.reshape(arr.shape[0] if batched else 1, -1)
    if rows.dtype.kind not in "biuf":
        raise invalid(f"classification needs a numeric output, got {rows.dtype}")
    k = min(k, rows.shape[1])
    top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        out[r] = [
            (f"{rows[r, i]:f}:{i}" + (f":{labels[i]}" if i < len(labels) else "")).encode()
            for i in top[r]
        ]
    return out if batched else out[0]


def _shortened(text: str, keep: int = 60) -> str:
    """``text`` for an error message: a long one cut, saying how long it was."""
    return text if len(text) <= keep + 20 else f"{text[:keep]}... ({len(text)} characters)"


def _checked(name: str, version: str) -> tuple[str, str]:
    """(name, version) once both are well formed; INVALID_ARG otherwise."""
    return names.check_model_and_version(name, version)


class DataPlane:
    def __init__(self, lifecycle: ModelLifeCycle, shared_memory: SharedMemoryRegistry) -> None:
        self.lifecycle = lifecycle
        self.shared_memory = shared_memory
        self.cuda_shared_memory = CudaSharedMemory()
        self.tracer = Tracer(lifecycle.server.trace_file, dict(lifecycle.server.trace_settings))
        self.log_settings = LogSettings(lifecycle.server.log_level)
        self.live = True
        self.accepting = True  # False once shutdown began: readiness goes false first
        server = lifecycle.server
        self.queued = QueuedBytes(
            server.max_queued_bytes or default_limit(server.memory_limit),
            server.max_queued_bytes_per_model,
            self._release_engine_memory,
        )

    async def _release_engine_memory(self) -> None:
        """After a burst: every loaded model's engines hand back the working memory
        they keep (bounded: a model busy again is not waited for past 5 s)."""
        waits = [
            asyncio.ensure_future(release())
            for servable in self.lifecycle.loaded()
            if (release := getattr(servable, "release_memory", None)) is not None
        ]
        if waits:
            await asyncio.wait(waits, timeout=5.0)

    # ---- health and metadata -----------------------------------------------------------

    def ready(self) -> bool:
        return self.accepting and self.lifecycle.all_ready()

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + (["system_shared_memory"] if self.shared_memory.enabled else [])
        if self.cuda_shared_memory.supported:
            extensions.append("cuda_shared_memory")
        name = self.lifecycle.server.server_name
        return {"name": name, "version": __version__, "extensions": extensions}

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for an unknown or unready model; INVALID_ARG for a malformed name."""
        try:
            return not self.model_unready_reason(name, version)
        except ApplianceError as exc:
            if exc.code is Code.NOT_FOUND:
                return False
            raise

    def model_unready_reason(self, name: str, version: str = "") -> str:
        """Why the model is not ready ("" when it is; an unknown model is not ready,
        in Triton's words); NOT_FOUND for a version the model lacks."""
        _checked(name, version)
        try:
            mv = self.lifecycle.get(name, version)
        except ApplianceError as exc:
            if exc.code is Code.NOT_FOUND:
                raise
            return exc.message
        return "" if mv.state == State.READY else f"model '{name}' is {mv.state.value}"

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        mv = self.lifecycle.get(*_checked(name, version))
        versions = [str(v) for v in sorted(self.lifecycle.entry(name).versions)]
        return mv.metadata(versions)

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return to_triton_json(self.lifecycle.get(*_checked(name, version)).config)

    # ---- inference ---------------------------------------------------------------------

    def serving(self, name: str, version: str) -> Servable | None:
        """The version :meth:`admit` would admit a request for now, or None where it
        would refuse it (nothing counted: the refusal is :meth:`admit`'s to make)."""
        try:
            return self.lifecycle.get(*_checked(name, version))
        except ApplianceError:
            return None

    def admit(
        self,
        name: str,
        version: str,
        nbytes: int = 0,
        held: Hold | None = None,
        servable: Servable | None = None,
    ) -> Ticket:
        """The request's :class:`~appliance.core.admission.Ticket`, taken by an adapter
        *before* it reads the payload: the model version looked up once (NOT_FOUND /
        UNAVAILABLE for one that cannot serve: refused before the payload is read), its
        rules, and a hold of ``nbytes`` (what the request declares) on the model's and
        the server's queued bytes (UNAVAILABLE when they do not fit; nothing is held
        then), or ``held``, a hold :meth:`reserve` took before the model was known,
        now counted at the model. Pass the ticket to :meth:`infer` and release it once
        answered. Shutting down is answered by :meth:`infer`, after the body was read:
        a connection whose request body is left unread would hold the shutdown while
        the server drains it. ``servable``: what :meth:`serving` returned for ``name``
        and ``version`` in this turn of the event loop (not looked up again)."""
        mv = servable if servable is not None else self.lifecycle.get(*_checked(name, version))
        try:
            if held is not None:
                hold = held
                hold.assign(mv.stats, mv.config.max_queued_bytes)
            else:
                hold = self.queued.hold(mv.stats, mv.config.max_queued_bytes)
                if nbytes:
                    hold.set(nbytes)
        except ApplianceError:
            mv.stats.record_failure(FailureReason.REJECTED, 0)
            raise
        return Ticket(mv, mv.rules, hold, self.lifecycle.server.max_request_elements)

    def reserve(self, nbytes: int) -> Hold:
        """A hold of ``nbytes`` on the server's queued bytes, for a payload whose model
        is not known until it is read (a gRPC message, reserved from its length prefix
        before it is kept): UNAVAILABLE when it does not fit. :meth:`admit` counts it
        at its model later; whoever took it releases it once answered."""
        hold = self.queued.hold(None)
        hold.set(nbytes)
        return hold

    async def infer(
        self,
        request: InferenceRequest,
        endpoint: str = "this endpoint",
        ticket: Ticket | None = None,
    ) -> InferenceResponse:
        """One request, one response. A decoupled model is refused with Triton's text
        (``endpoint`` names the caller: "HTTP end point", "ModelInfer RPC"). The decoded
        inputs are held (on ``ticket``'s hold, else one of its own) until the request
        is answered: beyond the queued-bytes limits it is refused UNAVAILABLE.

        With a ``ticket`` the request goes to the version that admitted it, with no
        second look-up, unless that version stopped serving meanwhile (a hot swap):
        then to the one serving now, checked in full."""
        if not self.accepting:
            raise unavailable("the server is shutting down")
        own = ticket is None
        if ticket is None:
            ticket = self.admit(request.model_name, request.model_version)
        mv = ticket.servable
        if mv.state is not State.READY:
            mv = self.lifecycle.get(*_checked(request.model_name, request.model_version))
        if mv.config.decoupled:
            raise invalid(
                f"{endpoint} doesn't support models with decoupled transaction policy "
                f"(model '{mv.config.name}' may send any number of responses a request: "
                "call it over a stream, e.g. gRPC ModelStreamInfer)"
            )
        try:
            try:
                ticket.hold.set(tensor_bytes(request.inputs))
            except ApplianceError:
                mv.stats.record_failure(FailureReason.REJECTED, 0)
                raise
            CONTENDED.set(self.queued.holding > 1)
            return await self._infer_one(mv, request, ticket.trusts(mv))
        finally:
            if own:
                ticket.release()

    async def _infer_one(
        self, mv: Servable, request: InferenceRequest, declared: bool = False
    ) -> InferenceResponse:
        """Run a request on its model version, traced when tracing picks it."""
        trace = None
        if self.tracer.active:  # one attribute read when tracing is off
            trace = self.tracer.begin(mv.config.name, time.perf_counter_ns())
        response: InferenceResponse = await mv.infer(request, declared)
        if trace is not None:
            self.tracer.finish(
                trace, response.model_version, request.id, response.timing, time.perf_counter_ns()
            )
        if request.classification:
            self._classify(request, response, mv.config)
        return response

    @staticmethod
    def _classify(request: InferenceRequest, response: InferenceResponse, config: Any) -> None:
        labels = {t.name: t.labels for t in config.outputs}
        for name, k in request.classification.items():
            if name not in response.outputs:
                continue  # the model left it out
            response.outputs[name] = classify(
                response.outputs[name], k, config.batch_size > 0, labels.get(name, ())
            )

    async def infer_stream(
        self, request: InferenceRequest, ticket: Ticket | None = None
    ) -> AsyncGenerator[tuple[InferenceResponse | ApplianceError, bool]]:
        """The responses of one request with their "final" flag: exactly one for a
        regular model; 0..N for a decoupled one, the last flagged final (its response
        may be empty: the model sent only the flag). An error the model sent comes
        as an :class:`ApplianceError` item and the stream goes on; a request that
        fails before the model ran raises. Closing the iterator early cancels the
        execution if it has not started. ``ticket``: as for :meth:`infer`."""
        if not self.accepting:
            raise unavailable("the server is shutting down")
        if ticket is not None and ticket.servable.state is State.READY:
            mv, declared = ticket.servable, ticket.trusts(ticket.servable)
        else:
            mv = self.lifecycle.get(*_checked(request.model_name, request.model_version))
            declared = False
        if not mv.config.decoupled:
            yield await self._infer_one(mv, request, declared), True
            return
        async for item, final in streaming.responses(mv, request, declared):
            if isinstance(item, ApplianceError):
                yield item, final
                continue
            outputs = reshape.outputs_for_client(mv.config, item or {})
            response = InferenceResponse(mv.config.name, str(mv.version), outputs, request.id)
            self._classify(request, response, mv.config)
            yield response, final

    async def infer_final(
        self, request: InferenceRequest, ticket: Ticket | None = None
    ) -> InferenceResponse:
        """A decoupled model's responses as one answer, for a wire that answers once
        (MQTT): :func:`appliance.decoupled.joined`; the first error sent is raised."""
        answer: InferenceResponse | None = None
        parts: list[dict[str, np.ndarray]] = []
        async for item, _final in self.infer_stream(request, ticket):
            if isinstance(item, ApplianceError):
                raise item
            answer = answer or item
            parts.append(item.outputs)
        if answer is None:
            raise invalid(f"model '{request.model_name}' sent no response")
        answer.outputs = joined(parts)
        return answer

    # ---- statistics and repository -----------------------------------------------------

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            _checked(name, version)
            if version:
                versions = [self.lifecycle.get(name, version)]
            else:
                versions = sorted(
                    self.lifecycle.entry(name).versions.values(), key=lambda mv: mv.version
                )
        else:
            versions = sorted(self.lifecycle.loaded(), key=lambda mv: (mv.config.name, mv.version))
        return {"model_stats": [mv.stats.json() for mv in versions]}

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows = self.lifecycle.index()
        return [r for r in rows if r.get("state") == "READY"] if ready_only else rows

    def _check_control(self, what: str) -> None:
        """UNAVAILABLE with Triton's text (its words for both modes) unless models are
        loaded on request (``explicit``), our reason after it."""
        mode = self.lifecycle.server.model_control_mode
        triton = "explicit model load / unload is not allowed if polling is enabled"
        if mode == "none":
            raise unavailable(
                f"{triton} (cannot {what} models: model control is off "
                "(model_control_mode: none); models load once at start)"
            )
        if mode == "poll":
            raise unavailable(
                f"{triton} (cannot {what} models on request: the repository is polled "
                "(model_control_mode: poll); change the files in the repository instead)"
            )

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Triton's repository load. Parameters: ``config`` (Triton's JSON model config,
        used instead of the repository's config file for this load) and ``in_place``
        (swap without room for two copies; the model is briefly unavailable) and
        ``default_version`` (the version unversioned requests go to, while the others
        are reachable by explicit version; absent: the newest)."""
        names.check_model_name(name)
        self._check_control("load")
        params = dict(parameters or {})
        files = sorted(k for k in params if k.startswith("file:"))
        # Triton's words when a load request yields no model (Triton answers INTERNAL)
        unpolled = f"failed to load '{name}', failed to poll from model repository"
        if files:
            # Triton's override files: the model's files travel in the request. Not taken
            # here: a Python model's files are code, and the appliance runs only what its
            # own repository holds.
            shown = [_shortened(f) for f in files]
            for key in files:
                longest = max(len(part.encode()) for part in key[len("file:") :].split("/"))
                if longest > names.MAX_NAME_BYTES:
                    # no file system takes the name (Triton 2.51 aborts on it)
                    raise internal(
                        f"{unpolled}: model file {_shortened(key)!r} has a path component of "
                        f"{longest} bytes; a file name has at most {names.MAX_NAME_BYTES}"
                    )
            if "config" not in params:
                raise invalid(
                    f"failed to load '{name}': load parameter 'config' must be provided "
                    f"together with model files {shown}"
                )
            raise invalid(
                f"{unpolled}: model files in a load request {shown} are not accepted by this "
                "server; place them in the model repository"
            )
        override = None
        if "config" in params:
            raw = params.pop("config")
            if isinstance(raw, dict):
                raw = json.dumps(raw)
            if not isinstance(raw, str):
                raise internal(
                    f"{unpolled}: load parameter 'config' must be the model config as a JSON string"
                )
            try:
                override = json_to_dict(raw, "load request parameter 'config'")
            except ApplianceError as exc:  # Triton's clients look for "failed to load"
                raise internal(f"{unpolled}: {exc.message}") from None
        in_place = params.pop("in_place", False)
        if isinstance(in_place, str) and in_place.lower() in ("true", "false"):
            in_place = in_place.lower() == "true"
        if not isinstance(in_place, bool):
            raise invalid(f"load parameter 'in_place' must be true or false, got {in_place!r}")
        default = params.pop("default_version", 0)
        if isinstance(default, str) and default.isdigit():
            default = int(default)
        if not isinstance(default, int) or isinstance(default, bool) or default < 0:
            raise invalid(
                f"load parameter 'default_version' must be a version number, got {default!r}"
            )
        if params:
            raise invalid(
                f"unsupported load parameter(s) {sorted(params)}: this server takes 'config', "
                "'in_place' and 'default_version' (model files come from the model repository)"
            )
        entry = await self.lifecycle.load(name, override, in_place, default)
        if entry.state != State.READY or entry.reason:  # a failed reload keeps the old copy
            raise invalid(f"failed to load '{name}': {entry.reason}")

    def start_shadow(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """Mirror a sample of ``name``'s unversioned traffic to a loaded candidate version
        and compare outputs (:mod:`appliance.core.shadow`); the report."""
        names.check_model_name(name)
        return self.lifecycle.entry(name).mirror(params)

    def shadow_report(self, name: str) -> dict[str, Any]:
        names.check_model_name(name)
        mirror = self.lifecycle.entry(name).shadow
        if mirror is None:
            raise not_found(f"model '{name}' has no shadow traffic (none was started)")
        return mirror.report()

    async def unload_model(self, name: str) -> None:
        names.check_model_name(name)
        self._check_control("unload")
        await self.lifecycle.unload(name)

    def memory(self) -> tuple[int | None, int]:
        """The memory budget: (limit in bytes or None when unlimited, bytes in use)."""
        return self.lifecycle.budget.limit, self.lifecycle.budget.used
