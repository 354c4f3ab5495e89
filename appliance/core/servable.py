"""What the lifecycle and the data plane serve: the servable interface and its states.

A servable is one loaded version of something that answers inference requests:
a plain model version (:class:`appliance.core.model.ModelVersion`, instances behind a
scheduler) or an ensemble (:class:`appliance.core.ensemble.runner.EnsembleVersion`, a DAG
over other servables, no instances or queue of its own). The lifecycle routes to,
reports on and unloads both through this interface alone, never by platform.

The request-level bookkeeping both share also lives here: a failed or cancelled
request is counted once, the same way, whatever served it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Iterator
from typing import Any, Protocol

from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.core.limits import RequestRules
from appliance.core.memory import Usage
from appliance.core.stats import ModelStats
from appliance.errors import ApplianceError, FailureReason
from appliance.request import InferenceRequest, InferenceResponse


class State(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class Servable(Protocol):
    """One loaded, routable version. Created READY by its loader.

    ``infer`` validates (with ``rules``; ``declared``: a codec already checked each
    input's declaration with them), runs and counts one request (raising ApplianceError);
    ``unload`` stops taking requests, drains what was accepted within the
    timeout, and frees what the version holds (instances, memory charge); after
    it ``state`` is UNAVAILABLE.
    """

    config: ModelConfig
    version: int
    state: State
    stats: ModelStats
    memory: Usage
    rules: RequestRules

    @property
    def ready(self) -> bool: ...

    async def infer(
        self, request: InferenceRequest, declared: bool = False
    ) -> InferenceResponse: ...

    def metadata(self, versions: list[str]) -> dict[str, Any]: ...

    async def unload(self, timeout_s: float) -> None: ...


def tensor_metadata(config: ModelConfig, versions: list[str]) -> dict[str, Any]:
    """KServe v2 model metadata of ``config``."""
    batch = [-1] if config.batch_size > 0 else []

    def tensor(t: TensorConfig) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}

    return {
        "name": config.name,
        "versions": versions,
        "platform": config.platform,
        "inputs": [tensor(t) for t in config.inputs],
        "outputs": [tensor(t) for t in config.outputs],
    }


@contextlib.contextmanager
def failures_counted(stats: ModelStats, start_ns: int) -> Iterator[None]:
    """Count a request that fails (its error's reason) or whose caller went away
    (CANCELED) inside the block; the exception goes on unchanged."""
    try:
        yield
    except ApplianceError as exc:
        stats.record_error(exc, time.perf_counter_ns() - start_ns)
        raise
    except asyncio.CancelledError:  # the caller went away (e.g. an in-process timeout)
        stats.record_failure(FailureReason.CANCELED, time.perf_counter_ns() - start_ns)
        raise
