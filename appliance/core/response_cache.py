"""Triton's response cache: a model's answers kept by a key over its inputs, so a
request seen before is answered without running the model.

One cache for the server, its size from the server config (``response_cache_size``,
Triton's ``--cache-config local,size=N``), charged to the memory budget at start; a
model uses it when its config says ``response_cache { enable: true }``. The key is a
BLAKE2b digest over the model's name and version and, for each input in name order,
its name, datatype, shape and bytes (a BYTES tensor in Triton's length-prefixed
form), and the outputs asked for: two requests with equal keys get equal answers.
Entries are copies of the outputs (read-only, so no caller can change what the next
one gets), counted by their bytes; the least recently used go first when an entry
would not fit, and an entry larger than the whole cache is not kept.

Only the event loop uses the cache (the model version looks up and inserts around
its scheduler), so it needs no lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from appliance import datatypes

__all__ = ["ResponseCache"]


def _nbytes(arr: np.ndarray) -> int:
    if arr.dtype.kind == "O":
        return arr.size * 8 + sum(len(x) for x in arr.ravel() if isinstance(x, (bytes, str)))
    return int(arr.nbytes)


class ResponseCache:
    """Outputs by request key, least recently used first out, within ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(
        model: str,
        version: str,
        inputs: Mapping[str, np.ndarray],
        outputs: tuple[str, ...],
        parameters: Mapping[str, str | int | float | bool] | None = None,
    ) -> bytes:
        """The digest two requests share exactly when they ask the same of a version:
        the same inputs, outputs and request parameters (a model may answer by them:
        a Python model's ``request.parameters()``)."""
        h = hashlib.blake2b(digest_size=32)
        for part in (model, version):
            h.update(part.encode("utf-8", "surrogatepass") + b"\0")
        for name in sorted(inputs):
            arr = inputs[name]
            datatype = datatypes.from_numpy_dtype(arr.dtype)
            h.update(f"{name}\0{datatype}\0{list(arr.shape)}\0".encode("utf-8", "surrogatepass"))
            if datatype == "BYTES":
                h.update(datatypes.serialize_bytes(arr))
            else:
                h.update(np.ascontiguousarray(arr).view(np.uint8).data)
        h.update("\0".join(outputs).encode("utf-8", "surrogatepass"))
        if parameters:  # typed: 1 and "1" and True are different parameters
            typed = sorted((k, type(v).__name__, repr(v)) for k, v in parameters.items())
            h.update(b"\0params\0" + repr(typed).encode("utf-8", "surrogatepass"))
        return h.digest()

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The outputs kept under ``key`` (a new dict of the read-only arrays), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return dict(entry[0])

    def put(self, key: bytes, outputs: Mapping[str, np.ndarray]) -> None:
        """Keep a copy of ``outputs`` under ``key``, making room by evicting the least
        recently used entries; an answer larger than the cache is not kept."""
        size = sum(_nbytes(a) for a in outputs.values())
        if size > self.limit or key in self._entries:
            return
        while self.used + size > self.limit:
            _, (_, freed) = self._entries.popitem(last=False)
            self.used -= freed
            self.evictions += 1
        kept = {}
        for name, arr in outputs.items():
            copy = np.array(arr, copy=True)
            copy.flags.writeable = False
            kept[name] = copy
        self._entries[key] = (kept, size)
        self.used += size
