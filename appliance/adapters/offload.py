"""When a protocol adapter moves codec work off the event loop: one rule for HTTP,
gRPC and MQTT.

Decoding or encoding a big payload on the event loop would stall every other
connection, while a thread hop costs tens of microseconds: small payloads stay on
the loop, big ones go to a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

# payloads above this are decoded/encoded on a worker thread
OFFLOAD_BYTES = 256 * 1024
# copying outputs into shared memory is a plain memcpy (~10 GB/s): worth a thread hop
# only for big tensors
OFFLOAD_COPY_BYTES = 4 * 1024 * 1024
# BYTES elements decoded or encoded on the event loop at most: each is a Python object
LOOP_OBJECTS = 4096


def tensor_bytes(tensors: dict[str, np.ndarray]) -> int:
    """The bytes a set of tensors holds (what encoding them walks)."""
    return sum(a.nbytes for a in tensors.values())


async def run(heavy: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: on a worker thread when ``heavy``, else here on the loop."""
    if heavy:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
