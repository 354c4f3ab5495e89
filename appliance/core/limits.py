"""How big a request may be, checked on what it declares before any element is decoded.

A tensor's declaration (name, datatype, shape) is read first; only once it passed
does a codec touch the data. The checks, in order, all with overflow-safe
arithmetic (a running product that stops as soon as it passes the bound):

1. the shape is well formed (:func:`appliance.datatypes.check_shape`, run by every
   codec): at most :data:`MAX_RANK` dimensions, each a non-negative integer, whose
   product (zero-size dimensions skipped, so ``[0, 2**62]`` counts as 2**62) stays
   within a ceiling numpy can hold;
2. the request's elements, over all inputs, stay within ``max_request_elements``
   (server config) — every element of a JSON or BYTES tensor becomes a Python object;
3. the shape fits the model's config: a known input, the declared datatype, the
   dims, and a batch size within ``1..max_batch_size``.

:class:`InputGate` runs 2 and 3 for one request against one model version; the
model runs 3 again on the decoded arrays (:func:`check_input`), so a request from
the in-process API meets the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.datatypes import DEFAULT_MAX_REQUEST_ELEMENTS, MAX_RANK, bounded_count
from appliance.errors import ApplianceError, invalid

__all__ = ["MAX_RANK", "InputGate", "bounded_count", "check_input"]


def check_input(config: ModelConfig, name: str, datatype: str, shape: Sequence[int]) -> int:
    """Check one input against the model's config; its batch size (0 when the model
    does not batch). INVALID_ARG naming the model and the input otherwise."""
    spec = _spec(config, name)
    where = f"input '{name}' of model '{config.name}'"
    if datatype != spec.datatype:
        raise invalid(f"{where}: expected datatype {spec.datatype}, got {datatype}")
    batched = config.batch_size > 0
    expected = ([-1] if batched else []) + list(spec.dims)
    if len(shape) != len(expected) or any(
        e not in (-1, s) for e, s in zip(expected, shape, strict=True)
    ):
        raise invalid(f"{where}: expected shape {expected}, got {_shown(list(shape))}")
    if not batched:
        return 0
    rows = int(shape[0])
    if not 1 <= rows <= config.batch_size:
        raise invalid(
            f"{where}: batch size {rows} is outside 1..{config.batch_size} (max_batch_size)"
        )
    return rows


def _spec(config: ModelConfig, name: str) -> TensorConfig:
    for t in config.inputs:
        if t.name == name:
            return t
    raise invalid(
        f"model '{config.name}' has no input '{name}'; "
        f"its inputs are {sorted(t.name for t in config.inputs)}"
    )


@dataclass(slots=True)
class InputGate:
    """The checks of one request's input declarations, called by a codec for each
    input before it decodes that input's data (see the module docstring).

    ``config`` None checks the sizes only. ``object_elements`` tallies the BYTES
    elements declared so far: each becomes a Python object when decoded, so an
    adapter decodes many of them off the event loop.
    """

    config: ModelConfig | None
    max_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS
    # told of each refusal (the model counts it as a failed request, as if it had
    # refused the decoded request itself)
    refused: Callable[[ApplianceError], None] | None = None
    elements: int = 0
    object_elements: int = 0

    def __call__(self, name: str, datatype: str, shape: Sequence[int]) -> None:
        try:
            self._check(name, datatype, shape)
        except ApplianceError as exc:
            if self.refused is not None:
                self.refused(exc)
            raise

    def _check(self, name: str, datatype: str, shape: Sequence[int]) -> None:
        count = bounded_count(shape, self.max_elements, f"input '{name}'")
        if self.config is not None:
            check_input(self.config, name, datatype, shape)
        if self.elements + count > self.max_elements:
            raise invalid(
                f"the request's inputs declare {self.elements + count} elements or more, "
                f"over this server's limit of {self.max_elements} (max_request_elements)"
            )
        self.elements += count
        if datatype == "BYTES":
            self.object_elements += count


def _shown(shape: Sequence[int]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "...]"
