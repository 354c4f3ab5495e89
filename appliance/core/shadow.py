"""Shadow traffic: a sample of a model's live requests mirrored to a candidate version,
its outputs compared with the serving version's.

Started for a model whose candidate version is loaded beside the serving one (the
OTA agent's shadow probation, before the switch: :meth:`start`), it wraps the copy
that unversioned requests are routed to. Such a request is answered by the serving
copy exactly as before; only once its answer is ready is it, if sampled, sent again
to the candidate in the background, and the candidate's outputs are compared with
the answer the client got. So mirroring never delays or fails a live request: the
extra work is one random draw per request and, for a sampled one, a copy of its
inputs (taken before the answer leaves, so a client rewriting its shared-memory
input afterwards cannot skew the comparison). At most ``max_in_flight`` mirrored
requests run at once (a sample arriving meanwhile is skipped and counted), on the
candidate's own instances. Requests to an explicit version are never mirrored.

Per output the comparison keeps the rows compared, the rows whose top-1 class (the
argmax over the last axis) agrees, the largest absolute difference of any element
and how many outputs differed in shape or datatype; what those numbers must be is
the caller's policy (the bundle's thresholds). Mirroring stops after
``max_requests`` comparisons and whenever the model is loaded or unloaded again;
the report stays readable until the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.config.model_config import ModelConfig
from appliance.core.limits import RequestRules
from appliance.core.memory import Usage
from appliance.core.servable import Servable, State
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, invalid
from appliance.request import InferenceRequest, InferenceResponse

log = logging.getLogger(__name__)

_OFF_LOOP_ELEMENTS = 1 << 16  # outputs bigger than this are compared on a worker thread


@dataclass(slots=True)
class Agreement:
    """How one output of the candidate agreed with the serving version's."""

    rows: int = 0
    top1_agree: int = 0
    max_abs_diff: float = 0.0
    mismatched: int = 0  # outputs whose shape or datatype differed

    def json(self) -> dict[str, Any]:
        diff = self.max_abs_diff if np.isfinite(self.max_abs_diff) else "inf"
        return {
            "rows": self.rows,
            "top1_agree": self.top1_agree,
            "max_abs_diff": diff,
            "mismatched": self.mismatched,
        }


def compare(live: np.ndarray, shadow: np.ndarray, into: Agreement) -> None:
    """Fold one output pair into ``into`` (pure numpy, no per-element Python work
    except for BYTES tensors, compared element by element)."""
    if live.shape != shadow.shape or live.dtype.kind != shadow.dtype.kind:
        into.mismatched += 1
        return
    if live.dtype.kind in "OSU":  # BYTES: equal or not
        equal = int(np.count_nonzero(live == shadow))
        into.rows += live.size
        into.top1_agree += equal
        if equal < live.size:
            into.max_abs_diff = float("inf")
        return
    a, b = live.astype(np.float64, copy=False), shadow.astype(np.float64, copy=False)
    if a.size:
        diff = np.abs(a - b)
        diff[np.isnan(a) & np.isnan(b)] = 0.0
        worst = float("inf") if np.isnan(diff).any() else float(diff.max())
        into.max_abs_diff = max(into.max_abs_diff, worst)
    if a.ndim >= 1 and a.shape[-1] > 1:
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        into.rows += rows_a.shape[0]
        into.top1_agree += int(np.count_nonzero(rows_a.argmax(-1) == rows_b.argmax(-1)))
    else:
        into.rows += max(1, a.size)
        into.top1_agree += int(np.count_nonzero(a == b)) if a.size else 1


class Shadow:
    """The copy unversioned requests of a model go to while its traffic is mirrored
    (see the module docstring); everything but :meth:`infer` is the serving copy's."""

    def __init__(
        self,
        serving: Servable,
        candidate: Servable,
        sample_rate: float,
        max_in_flight: int,
        max_requests: int,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.serving, self.candidate, self.draw = serving, candidate, draw
        self.sample_rate, self.max_in_flight, self.max_requests = (
            sample_rate,
            max_in_flight,
            max_requests,
        )
        # the serving copy's face: the same objects, so nothing else can tell
        self.config: ModelConfig = serving.config
        self.version: int = serving.version
        self.stats: ModelStats = serving.stats
        self.memory: Usage = serving.memory
        self.rules: RequestRules = serving.rules
        self.active = True
        self.offered = 0  # live requests seen
        self.sampled = 0  # of them, mirrored
        self.skipped_busy = 0  # sampled while max_in_flight were running
        self.compared = 0
        self.failed = 0  # mirrored requests the candidate failed
        self.outputs: dict[str, Agreement] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def state(self) -> State:
        return self.serving.state

    @state.setter
    def state(self, value: State) -> None:
        self.serving.state = value

    @property
    def ready(self) -> bool:
        return self.serving.ready

    def metadata(self, versions: list[str]) -> dict[str, Any]:
        return self.serving.metadata(versions)

    async def unload(self, timeout_s: float) -> None:
        await self.serving.unload(timeout_s)

    # ---- mirroring --------------------------------------------------------------------

    async def infer(self, request: InferenceRequest, declared: bool = False) -> InferenceResponse:
        response = await self.serving.infer(request, declared)
        if self.active:
            try:
                self._offer(request, response)
            except Exception:  # never the live request's problem
                log.exception("shadow traffic: mirroring a request failed")
                self.failed += 1
        return response

    def _offer(self, request: InferenceRequest, response: InferenceResponse) -> None:
        self.offered += 1
        if self.draw() >= self.sample_rate:
            return
        if len(self._tasks) >= self.max_in_flight:
            self.skipped_busy += 1
            return
        self.sampled += 1
        mirrored = InferenceRequest(
            request.model_name,
            {name: np.array(a, copy=True) for name, a in request.inputs.items()},
            str(self.candidate.version),
            tuple(response.outputs),
            timeout_us=request.timeout_us,
        )
        task = asyncio.get_running_loop().create_task(
            self._mirror(mirrored, dict(response.outputs))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mirror(self, request: InferenceRequest, live: dict[str, np.ndarray]) -> None:
        try:
            response = await self.candidate.infer(request)
        except ApplianceError:
            self.failed += 1
            return
        pairs = [(name, a, response.outputs.get(name)) for name, a in live.items()]
        if sum(a.size for _, a, _ in pairs) > _OFF_LOOP_ELEMENTS:
            await asyncio.to_thread(self._fold, pairs)
        else:
            self._fold(pairs)
        self.compared += 1
        if self.compared >= self.max_requests:
            self.active = False

    def _fold(self, pairs: list[tuple[str, np.ndarray, np.ndarray | None]]) -> None:
        for name, a, b in pairs:
            agreement = self.outputs.setdefault(name, Agreement())
            if b is None:
                agreement.mismatched += 1
            else:
                compare(a, b, agreement)

    def report(self) -> dict[str, Any]:
        return {
            "model": self.serving.config.name,
            "serving_version": self.serving.version,
            "version": self.candidate.version,
            "active": self.active,
            "sample_rate": self.sample_rate,
            "offered": self.offered,
            "sampled": self.sampled,
            "skipped_busy": self.skipped_busy,
            "compared": self.compared,
            "failed": self.failed,
            "outputs": {name: a.json() for name, a in sorted(self.outputs.items())},
        }


def _number(params: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key, default)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise invalid(
            f"shadow parameter '{key}' must be a number in [{low:g}, {high:g}], got {value!r}"
        )
    return float(value)


def start(serving: Servable, candidate: Servable, params: dict[str, Any]) -> Shadow:
    """A shadow of ``serving`` mirroring to ``candidate``; INVALID_ARG for parameters
    out of range or a model whose requests cannot be mirrored."""
    unknown = sorted(set(params) - {"version", "sample_rate", "max_in_flight", "max_requests"})
    if unknown:
        raise invalid(
            f"unsupported shadow parameter(s) {unknown}: expected version, sample_rate, "
            "max_in_flight, max_requests"
        )
    name = serving.config.name
    if candidate is serving or candidate.version == serving.version:
        raise invalid(
            f"model '{name}' version {candidate.version} is the one serving: nothing to shadow"
        )
    if serving.config.decoupled or serving.config.sequence_batching is not None:
        raise invalid(
            f"model '{name}': shadow traffic needs stateless, one-response requests (not a "
            "decoupled or sequence model)"
        )
    if not candidate.ready:
        raise invalid(f"model '{name}' version {candidate.version} is not ready")
    return Shadow(
        serving,
        candidate,
        _number(params, "sample_rate", 0.1, 1e-6, 1.0),
        int(_number(params, "max_in_flight", 1, 1, 16)),
        int(_number(params, "max_requests", 100, 1, 1_000_000)),
    )
