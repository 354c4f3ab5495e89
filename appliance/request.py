"""The protocol-neutral request and response every adapter builds and encodes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from appliance.errors import invalid

_UINT64_MAX = 2**64 - 1


@dataclass(slots=True)
class InferenceRequest:
    """One decoded inference call.

    ``inputs`` arrays may be read-only views of the wire buffer; nothing below the
    adapter writes to them. ``outputs`` empty means every output of the model.
    """

    model_name: str
    inputs: dict[str, np.ndarray]
    model_version: str = ""  # "" = the newest ready version
    outputs: tuple[str, ...] = ()
    id: str = ""
    timeout_us: int | None = None  # per-request queue timeout (Triton's "timeout" parameter)
    # output name -> k: return the top-k classes as "value:index" strings (Triton's
    # classification extension) instead of the raw tensor
    classification: dict[str, int] = field(default_factory=dict)
    # Triton's sequence parameters (stateful models): 0 or "" = not part of a sequence
    sequence_id: int | str = 0
    sequence_start: bool = False
    sequence_end: bool = False
    # the request's own parameters that are not the server's (Triton's generate
    # extension passes them on): name -> string, number or boolean. A decoupled model
    # reads them (:attr:`appliance.decoupled.RequestInputs.parameters`)
    parameters: dict[str, str | int | float | bool] = field(default_factory=dict)
    # Triton's priority parameter: 1 is served first; 0 = the model's default level
    priority: int = 0


def check_priority(value: object) -> int:
    """A ``priority`` parameter as sent: an unsigned 64-bit integer."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX:
        return value
    raise invalid(f"request parameter 'priority' must be an unsigned integer, got {value!r}")


def check_sequence_id(value: object) -> int | str:
    """A ``sequence_id`` parameter as sent: an unsigned 64-bit integer or a string."""
    if isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX
    ):
        return value
    raise invalid(
        f"request parameter 'sequence_id' must be an unsigned 64-bit integer or a string, "
        f"got {value!r}"
    )


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    id: str = ""
    # when the model ran: (start, queue, input, infer, output, end), monotonic ns
    # (start, end) and durations in ns; for traces
    timing: tuple[int, int, int, int, int, int] | None = None
