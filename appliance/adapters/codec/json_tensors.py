"""Large JSON requests: tensor ``data`` lists parsed straight into typed buffers.

orjson turns every number of a ``data`` list into a Python float before numpy
copies it into an array: for a camera frame sent as JSON (150,528 numbers) that
is most of the request's CPU time, all of it holding the GIL. When the optional
``pysimdjson`` package is installed (``pip install appliance[fastjson]``), bodies
above :data:`MIN_BYTES` are parsed with simdjson instead: the document's small
parts (names, shapes, parameters, outputs) become Python objects as orjson would
make them, while each input's flat numeric ``data`` list stays a :class:`LazyData`
and becomes an array through simdjson's typed buffer (``as_buffer``: one C loop
into float64/int64/uint64, no Python object per element; numbers are parsed
correctly rounded, so values equal orjson's).

Anything unusual (nested or mixed lists, booleans, values out of the dtype's range,
malformed JSON) falls back to the orjson path, so errors and their messages stay
exactly those of :mod:`appliance.adapters.codec.kserve` and :mod:`appliance.datatypes`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from appliance import datatypes
from appliance.errors import invalid


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# optional: the appliance[fastjson] extra; tests set it to None to take the orjson path
simdjson: Any = _optional("simdjson")

AVAILABLE = simdjson is not None
# below this the orjson path is as fast (few numbers) and simpler
MIN_BYTES = 64 * 1024
# simdjson buffer type -> numpy dtype it fills
_BUFFER = {"d": np.dtype(np.float64), "i": np.dtype(np.int64), "u": np.dtype(np.uint64)}


class LazyData:
    """An input's ``data`` list, still in simdjson's document."""

    __slots__ = ("_array",)

    def __init__(self, array: Any) -> None:
        self._array = array

    def to_list(self) -> Any:
        return self._array.as_list()

    def to_tensor(self, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
        """The tensor, or the orjson path's result (and errors) when not a plain case."""
        arr = self._fast(datatype)
        if arr is None:
            return datatypes.from_json_data(self.to_list(), datatype, shape, name)
        expected = datatypes.element_count(shape)
        if arr.size != expected:
            raise invalid(
                f"input '{name}': 'data' has {arr.size} elements but shape {list(shape)} "
                f"needs {expected}"
            )
        return arr.reshape(shape)

    def _fast(self, datatype: str) -> np.ndarray | None:
        if datatype in ("BYTES", "BOOL") or not len(self._array):
            return None
        if isinstance(self._array[0], simdjson.Array):
            return None  # nested lists: the orjson path checks they are not ragged
        dtype = datatypes.to_numpy_dtype(datatype)
        kinds = "d" if dtype.kind == "f" else ("i", "u")
        for kind in kinds:
            try:
                raw = np.frombuffer(self._array.as_buffer(of_type=kind), dtype=_BUFFER[kind])
            except (TypeError, ValueError):
                continue  # another element type (e.g. a float among integers)
            if dtype.kind == "f":
                # ints among floats are fine for a float input, as on the orjson path
                return raw.astype(dtype)
            info = np.iinfo(dtype)
            if raw.size and (raw.min() < info.min or raw.max() > info.max):
                return None  # the orjson path names the value that does not fit
            return raw.astype(dtype)
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def loads(body: bytes | memoryview) -> dict[str, Any] | None:
    """The request document with inputs' ``data`` as :class:`LazyData`, or None when
    simdjson is missing, the body is small, or anything looks unusual (the caller
    then parses with orjson)."""
    if simdjson is None or len(body) < MIN_BYTES:
        return None
    # a parser per document: a parser refuses a new document while proxies of its last
    # one live on (say, in a traceback), and making one costs nothing next to parsing
    try:
        top = simdjson.Parser().parse(bytes(body))
        if not isinstance(top, simdjson.Object):
            return None
        doc: dict[str, Any] = {}
        for key in top:  # items() would turn every value into Python objects
            value = top[key]
            if key == "inputs" and isinstance(value, simdjson.Array):
                doc[key] = [_input(item) for item in value]
            else:
                doc[key] = _plain(value)
        return doc
    except (ValueError, TypeError, KeyError, RuntimeError):
        return None  # malformed or odd: the orjson path reports it precisely


def _input(item: Any) -> Any:
    if not isinstance(item, simdjson.Object):
        return _plain(item)
    fields = {}
    for k in item:
        v = item[k]
        fields[k] = LazyData(v) if k == "data" and isinstance(v, simdjson.Array) else _plain(v)
    return fields
