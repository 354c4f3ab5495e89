"""Triton's CUDA shared-memory extension on a device without CUDA IPC support.

tritonclient's shared-memory examples (and much client code written for Triton)
call ``unregister_cuda_shared_memory()`` before anything else, and some list the
CUDA regions. A Triton built without GPU support still answers those routes: the
status is an empty list, unregistering (one region or all) succeeds, and only
registering a region fails. This module gives the same answers, so such clients
run unchanged here; registering answers INVALID_ARG with a message saying what to
use instead. Both adapters (HTTP and gRPC) call this one object.
"""

from __future__ import annotations

from typing import Any

from appliance.errors import invalid, not_found


class CudaSharedMemory:
    """The CUDA shared-memory registry of a device where none can be registered."""

    supported = False

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Triton's status list; always empty. A named region cannot exist: NOT_FOUND."""
        if name:
            raise not_found(f"Unable to find cuda shared memory region: '{name}'")
        return []

    def register(self, name: str, device_id: int, byte_size: int) -> None:
        raise invalid(
            f"failed to register CUDA shared memory region '{name}' (device {device_id}, "
            f"{byte_size} bytes): CUDA shared memory is not supported on this device; "
            "use system shared memory (shared_memory: system)"
        )

    def unregister(self, name: str = "") -> None:
        """Nothing is ever registered: unregistering one region or all succeeds, as in
        Triton for a name it does not know."""
