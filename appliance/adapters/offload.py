"""When codec work leaves the event loop: the measures of the one offload rule, which
:mod:`appliance.adapters.exchange` applies to every wire (HTTP, gRPC, MQTT, the
in-process API) and :mod:`appliance.adapters.grpc.messages` to inflating messages.

Decoding or encoding a big payload on the event loop would stall every other
connection, while a thread hop costs tens of microseconds: small payloads stay on
the loop, big ones go to a worker thread.
"""

from __future__ import annotations

# payloads above this are read and decoded, and text answers above it encoded, on a
# worker thread
OFFLOAD_BYTES = 256 * 1024
# copying outputs (into shared memory, or one wire buffer) is a plain memcpy (~10 GB/s):
# worth a thread hop only for big tensors
OFFLOAD_COPY_BYTES = 4 * 1024 * 1024
# BYTES elements decoded or encoded on the event loop at most: each is a Python object
LOOP_OBJECTS = 4096
