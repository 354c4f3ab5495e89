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

A request's :class:`~appliance.core.admission.Ticket` runs 2 and 3 on each input a
codec declares (3 is :meth:`RequestRules.declare`); a request no codec declared (the
in-process API, an ensemble step) meets the same rules on its decoded arrays
(:meth:`RequestRules.check`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from appliance import datatypes
from appliance.config.model_config import ModelConfig, TensorConfig
from appliance.datatypes import MAX_RANK, bounded_count, fits
from appliance.errors import ApplianceError, invalid
from appliance.request import InferenceRequest

__all__ = ["MAX_RANK", "RequestRules", "bounded_count", "count_elements"]


def _check(
    config: ModelConfig,
    spec: TensorConfig,
    name: str,
    datatype: str,
    shape: Sequence[int],
    expected: Sequence[int] | None = None,
) -> int:
    """One input against its config: its batch rows (0 when the model does not batch).
    ``expected``: the dims the config gives it, batch dimension first (-1: any)."""
    if expected is None:
        expected = _expected(config, spec)
    if datatype != spec.datatype:
        where = f"input '{name}' of model '{config.name}'"
        raise invalid(f"{where}: expected datatype {spec.datatype}, got {datatype}")
    if not fits(expected, shape):
        where = f"input '{name}' of model '{config.name}'"
        raise invalid(f"{where}: expected shape {list(expected)}, got {_shown(list(shape))}")
    limit = config.max_batch_size
    if not limit or limit <= 0:
        return 0
    rows = int(shape[0])
    if not 1 <= rows <= limit:
        where = f"input '{name}' of model '{config.name}'"
        raise invalid(f"{where}: batch size {rows} is outside 1..{limit} (max_batch_size)")
    return rows


def _expected(config: ModelConfig, spec: TensorConfig) -> tuple[int, ...]:
    return ((-1,) if config.batch_size > 0 else ()) + tuple(spec.dims)


class RequestRules:
    """How a request is checked against one config: names, datatypes, shapes and batch
    size, with what it needs derived once (a servable keeps one: nothing is rebuilt
    per request).

    A codec declares each input (:meth:`declare`, through the request's
    :class:`~appliance.core.admission.Ticket`) before it decodes it, and decodes it to
    exactly that declaration; :meth:`check` then trusts those declarations
    (``declared``) and checks only what needs the whole request: the inputs the model
    requires, one batch size, the outputs asked for. A request that no codec declared
    (the in-process API, an ensemble step) is checked in full on its arrays.
    """

    __slots__ = ("_expected", "_outputs", "_required", "_specs", "batched", "config")

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._specs = {t.name: t for t in config.inputs}
        self._expected = {t.name: _expected(config, t) for t in config.inputs}
        self._required = tuple(t.name for t in config.inputs if not t.optional)
        self._outputs = tuple(t.name for t in config.outputs)
        self.batched = config.batch_size > 0

    def declare(self, name: str, datatype: str, shape: Sequence[int]) -> int:
        """One input's declaration: its batch size (0 when the model does not batch);
        INVALID_ARG naming the model and the input otherwise."""
        spec = self._specs.get(name)
        if spec is None:
            raise self._unknown(name)
        return _check(self.config, spec, name, datatype, shape, self._expected[name])

    def check(
        self, request: InferenceRequest, declared: bool = False
    ) -> tuple[tuple[str, ...], int, Hashable]:
        """Validate ``request``: (the outputs to return, its batch rows (1 when the
        model doesn't batch), the shape signature batches group by)."""
        config, specs, inputs = self.config, self._specs, request.inputs
        if len(inputs) > len(specs):
            raise self._count(list(inputs))
        for name in self._required:
            if name not in inputs:
                raise self._count(list(inputs))
        for name in inputs:
            if name not in specs:
                raise self._unknown(name)
        batched = self.batched
        rows: set[int] = set()
        for name, spec in specs.items():
            arr = inputs.get(name)
            if arr is None:
                continue  # optional: the count above found every required one
            if declared:  # decoded to a declaration these rules passed
                rows.add(int(arr.shape[0]) if batched else 0)
            else:
                dtype = datatypes.from_numpy_dtype(arr.dtype)
                rows.add(_check(config, spec, name, dtype, arr.shape, self._expected[name]))
        if len(rows) > 1:
            raise invalid(
                f"inputs of model '{config.name}' disagree on the batch size: {sorted(rows)}"
            )
        names = self._outputs
        for name in request.outputs:
            if name not in names:
                raise invalid(
                    f"model '{config.name}' has no output '{name}'; its outputs are {list(names)}"
                )
        # requests whose non-batch shapes differ must never share a batch
        if len(inputs) == 1:
            ((only, arr),) = inputs.items()
            signature: Hashable = ((only, arr.shape[1:]),)
        else:
            signature = tuple((n, a.shape[1:]) for n, a in sorted(inputs.items()))
        return request.outputs or names, max(rows.pop(), 1) if rows else 1, signature

    def _unknown(self, name: str) -> ApplianceError:
        return invalid(
            f"unexpected inference input '{name}' for model '{self.config.name}': the model "
            f"has no input '{name}'; its inputs are {sorted(self._specs)}"
        )

    def _count(self, inputs: Sequence[str]) -> ApplianceError:
        """Triton's text for a request with too many inputs or without a required one."""
        total, required = len(self._specs), len(self._required)
        expected = (
            f"expected {total} inputs"
            if total == required
            else f"expected number of inputs between {required} and {total}"
        )
        given = ",".join(f"'{n}'" for n in inputs)
        missing = ",".join(f"'{n}'" for n in self._required if n not in inputs)
        return invalid(
            f"{expected} but got {len(inputs)} inputs for model '{self.config.name}'. Got "
            f"input(s) [{given}], but missing required input(s) [{missing}]. Please provide "
            "all required input(s)."
        )


def count_elements(shape: Sequence[int], total: int, bound: int, name: str) -> int:
    """The elements of one more input's ``shape``, the request's inputs so far holding
    ``total``; INVALID_ARG once they pass ``bound`` (``max_request_elements``)."""
    count = bounded_count(shape, bound, f"input '{name}'")
    if total + count > bound:
        raise invalid(
            f"the request's inputs declare {total + count} elements or more, "
            f"over this server's limit of {bound} (max_request_elements)"
        )
    return count


def _shown(shape: Sequence[int]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "...]"
