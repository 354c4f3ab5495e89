"""The data plane: the one entry every protocol adapter calls.

HTTP, gRPC, MQTT and the in-process API all turn their wire format into an
:class:`InferenceRequest` and call :meth:`DataPlane.infer`; metadata, config,
statistics and repository control live here too, so no adapter holds logic of
its own. Everything raises :class:`ApplianceError`, never a protocol status.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from appliance import __version__
from appliance.errors import ApplianceError, FailureReason, invalid, unavailable
from appliance.lifecycle import ModelLifeCycle
from appliance.model import State
from appliance.queue_bytes import Hold, QueuedBytes, default_limit, tensor_bytes
from appliance.request import InferenceRequest, InferenceResponse
from appliance.shared_memory import SharedMemoryRegistry
from appliance.triton_config import json_to_dict, to_triton_json

EXTENSIONS = [
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
]


def classify(arr: np.ndarray, k: int, batched: bool) -> np.ndarray:
    """Triton's classification extension: the top-k entries of each batch row as
    BYTES "value:index" strings, highest first."""
    rows = arr.reshape(arr.shape[0] if batched else 1, -1)
    if rows.dtype.kind not in "biuf":
        raise invalid(f"classification needs a numeric output, got {rows.dtype}")
    k = min(k, rows.shape[1])
    top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        out[r] = [f"{rows[r, i]:f}:{i}".encode() for i in top[r]]
    return out if batched else out[0]


class DataPlane:
    def __init__(self, lifecycle: ModelLifeCycle, shared_memory: SharedMemoryRegistry) -> None:
        self.lifecycle = lifecycle
        self.shared_memory = shared_memory
        self.live = True
        self.accepting = True  # False once shutdown began: readiness goes false first
        server = lifecycle.server
        self.queued = QueuedBytes(
            server.max_queued_bytes or default_limit(server.memory_limit),
            server.max_queued_bytes_per_model,
        )

    # ---- health and metadata -----------------------------------------------------------

    def ready(self) -> bool:
        return self.accepting and self.lifecycle.all_ready()

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + (["system_shared_memory"] if self.shared_memory.enabled else [])
        return {"name": "appliance", "version": __version__, "extensions": extensions}

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.lifecycle.get(name, version).state == State.READY
        except Exception:
            return False

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        mv = self.lifecycle.get(name, version)
        versions = [str(v) for v in sorted(self.lifecycle.entry(name).versions)]
        return mv.metadata(versions)

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return to_triton_json(self.lifecycle.get(name, version).config)

    # ---- inference ---------------------------------------------------------------------

    def reserve(self, name: str, version: str, nbytes: int) -> Hold:
        """A hold of ``nbytes`` on the model's and the server's queued bytes, taken by an
        adapter *before* it reads a request's payload (sized by what the request
        declares); pass it to :meth:`infer`, and release it once answered. Raises
        UNAVAILABLE when the bytes do not fit (nothing is held then). Shutting down is
        answered by :meth:`infer`, after the body was read: a connection whose request
        body is left unread would hold the shutdown while the server drains it."""
        mv = self.lifecycle.get(name, version)
        hold = self.queued.hold(mv.stats, mv.max_queued_bytes)
        try:
            hold.set(nbytes)
        except ApplianceError:
            mv.stats.record_failure(FailureReason.REJECTED, 0)
            raise
        return hold

    async def infer(self, request: InferenceRequest, hold: Hold | None = None) -> InferenceResponse:
        """Run one request. Its decoded inputs are held (``hold``, else a hold of its own)
        until it is answered: beyond the queued-bytes limits it is refused UNAVAILABLE."""
        if not self.accepting:
            raise unavailable("the server is shutting down")
        mv = self.lifecycle.get(request.model_name, request.model_version)
        own = hold is None
        if hold is None:
            hold = self.queued.hold(mv.stats, mv.max_queued_bytes)
        try:
            try:
                hold.set(tensor_bytes(request.inputs))
            except ApplianceError:
                mv.stats.record_failure(FailureReason.REJECTED, 0)
                raise
            response = await mv.infer(request)
        finally:
            if own:
                hold.release()
        for name, k in request.classification.items():
            response.outputs[name] = classify(response.outputs[name], k, mv.config.batch_size > 0)
        return response

    # ---- statistics and repository -----------------------------------------------------

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
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
        mode = self.lifecycle.server.model_control_mode
        if mode == "none":
            raise invalid(
                f"cannot {what} models: model control is off (model_control_mode: none); "
                "models load once at start"
            )
        if mode == "poll":
            raise invalid(
                f"cannot {what} models on request: the repository is polled "
                "(model_control_mode: poll); change the files in the repository instead"
            )

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Triton's repository load. Parameters: ``config`` (Triton's JSON model config,
        used instead of the repository's config file for this load) and ``in_place``
        (swap without room for two copies; the model is briefly unavailable)."""
        self._check_control("load")
        params = dict(parameters or {})
        override = None
        if "config" in params:
            raw = params.pop("config")
            if isinstance(raw, dict):
                raw = json.dumps(raw)
            if not isinstance(raw, str):
                raise invalid("load parameter 'config' must be the model config as a JSON string")
            override = json_to_dict(raw, f"load request for model '{name}': parameter 'config'")
        in_place = params.pop("in_place", False)
        if isinstance(in_place, str) and in_place.lower() in ("true", "false"):
            in_place = in_place.lower() == "true"
        if not isinstance(in_place, bool):
            raise invalid(f"load parameter 'in_place' must be true or false, got {in_place!r}")
        if params:
            raise invalid(
                f"unsupported load parameter(s) {sorted(params)}: this server takes 'config' "
                "and 'in_place' (model files come from the model repository)"
            )
        entry = await self.lifecycle.load(name, override, in_place)
        if entry.state != State.READY or entry.reason:  # a failed reload keeps the old copy
            raise invalid(f"failed to load model '{name}': {entry.reason}")

    async def unload_model(self, name: str) -> None:
        self._check_control("unload")
        await self.lifecycle.unload(name)

    def memory(self) -> tuple[int | None, int]:
        """The memory budget: (limit in bytes or None when unlimited, bytes in use)."""
        return self.lifecycle.budget.limit, self.lifecycle.budget.used
