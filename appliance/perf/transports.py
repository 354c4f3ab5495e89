"""How ``appliance perf`` sends requests: one class per transport, same small interface.

Every transport gets the samples once (:meth:`Transport.open`) and prebuilds what
it sends, so a request while measuring costs a write and a read: HTTP binary
bodies, serialized gRPC messages (sent as bytes, no per-request protobuf work),
shared-memory regions filled once (inputs) and one output slice per slot, MQTT
v5 payloads with their properties. ``slot`` is the caller's outstanding-request
index (a connection, an output slice). Failures raise
:class:`~appliance.perf.httpclient.RequestFailed` with a kind for the error table.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from appliance.adapters.grpc import libraries as grpc_libraries
from appliance.datatypes import from_numpy_dtype, to_raw
from appliance.errors import ApplianceError, Code, invalid
from appliance.perf.httpclient import (
    HEADER_LENGTH,
    Admin,
    Connection,
    RequestFailed,
    binary_body,
    build_request,
    error_kind,
    model_path,
    split_url,
)
from appliance.perf.workload import TensorSpec

MQTT_REPLY_TIMEOUT_S = 30.0  # a request the bridge never answers counts as an error
_runs = itertools.count()  # shared-memory region names unique within the process
Samples = Sequence[Mapping[str, np.ndarray]]


class Transport(abc.ABC):
    """Base: ``open`` prebuilds, ``infer`` sends sample ``i`` on ``slot``, ``close``."""

    name = "base"

    @abc.abstractmethod
    async def open(self, samples: Samples, slots: int) -> None:
        """Prebuild the requests for ``samples``; ``slots``: most outstanding requests."""

    @abc.abstractmethod
    async def infer(self, sample: int, slot: int) -> None:
        """Send sample ``sample`` and wait for its reply; RequestFailed on an error."""

    async def close(self) -> None:
        return None


class HttpTransport(Transport):
    """KServe v2 over HTTP/1.1 with the binary extension, one connection per slot."""

    name = "http"

    def __init__(
        self, url: str, model: str, version: str = "", token: str = "", json: bool = False
    ) -> None:
        self.json = json  # tensors as JSON "data" lists, as curl and KServe's clients send
        self.host, self.port = split_url(url, 8000)
        self.path = model_path(model, version) + "/infer"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._requests: list[bytes] = []
        self._conns: list[Connection] = []

    def _prebuild(self, body: bytes, header_length: int) -> bytes:
        headers = {
            **self.headers,
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(header_length),
        }
        return build_request("POST", self.path, f"{self.host}:{self.port}", body, headers)

    def _prebuild_json(self, sample: Mapping[str, np.ndarray]) -> bytes:
        inputs = [
            {
                "name": n,
                "shape": list(a.shape),
                "datatype": from_numpy_dtype(a.dtype),
                "data": [x.decode("utf-8", "replace") for x in a.ravel()]
                if a.dtype == object
                else a.ravel(),
            }
            for n, a in sample.items()
        ]
        body = orjson.dumps({"inputs": inputs}, option=orjson.OPT_SERIALIZE_NUMPY)
        headers = {**self.headers, "Content-Type": "application/json"}
        return build_request("POST", self.path, f"{self.host}:{self.port}", body, headers)

    async def open(self, samples: Samples, slots: int) -> None:
        if self.json:
            self._requests = [self._prebuild_json(s) for s in samples]
        else:
            self._requests = [self._prebuild(*binary_body(s)) for s in samples]
        self._conns = [Connection(self.host, self.port) for _ in range(slots)]

    async def infer(self, sample: int, slot: int) -> None:
        status, body = await self._conns[slot].send(self._requests[sample])
        if status != 200:
            raise RequestFailed(error_kind(f"HTTP {status}", body))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._conns))


class ShmTransport(HttpTransport):
    """HTTP requests whose inputs and outputs live in system shared memory.

    Inputs: one region holding every sample, registered once. Outputs: one region
    with a slice per slot, so outstanding requests never write over each other.
    """

    name = "shm"

    def __init__(self, url: str, model: str, outputs: Sequence[TensorSpec], **kw: Any) -> None:
        super().__init__(url, model, **kw)
        self.admin = Admin(url, kw.get("token", ""))
        self.outputs = outputs
        self._key = f"appliance-perf-{os.getpid()}-{next(_runs)}"
        self._files: list[Path] = []
        self._regions: list[str] = []

    def _region(self, suffix: str, size: int) -> tuple[str, np.memmap]:
        name = f"{self._key}-{suffix}"
        path = Path("/dev/shm") / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._files.append(path)
        try:
            os.ftruncate(fd, max(size, 1))
        finally:
            os.close(fd)
        return name, np.memmap(path, dtype=np.uint8, mode="r+", shape=(max(size, 1),))

    async def open(self, samples: Samples, slots: int) -> None:
        sizes = [o.fixed_bytes for o in self.outputs]
        if any(s is None for s in sizes):
            raise invalid("--transport shm needs outputs of fixed size (no BYTES, no -1 dims)")
        out_size = sum(s or 0 for s in sizes)
        raws = [{n: bytes(to_raw(a)) for n, a in s.items()} for s in samples]
        in_name, in_map = self._region("in", sum(len(r) for s in raws for r in s.values()))
        out_name, _ = self._region("out", out_size * slots)
        offset, refs = 0, []
        for sample in raws:
            ref = {}
            for n, raw in sample.items():
                in_map[offset : offset + len(raw)] = np.frombuffer(raw, np.uint8)
                ref[n] = (in_name, offset, len(raw))
                offset += len(raw)
            refs.append(ref)
        in_map.flush()
        for name in (in_name, out_name):
            region_size = (Path("/dev/shm") / name).stat().st_size
            body = {"key": f"/{name}", "offset": 0, "byte_size": region_size}
            await self.admin.post(f"/v2/systemsharedmemory/region/{name}/register", body)
            self._regions.append(name)
        # requests[slot * len(samples) + sample]: the output slice depends on the slot
        self._requests = []
        for slot in range(slots):
            outs, pos = {}, slot * out_size
            for spec, size in zip(self.outputs, sizes, strict=True):
                outs[spec.name] = (out_name, pos, size or 0)
                pos += size or 0
            for values, ref in zip(samples, refs, strict=True):
                self._requests.append(self._prebuild(*binary_body(values, (), ref, outs)))
        self._per_slot = len(samples)
        self._conns = [Connection(self.host, self.port) for _ in range(slots)]

    async def infer(self, sample: int, slot: int) -> None:
        raw = self._requests[slot * self._per_slot + sample]
        status, body = await self._conns[slot].send(raw)
        if status != 200:
            raise RequestFailed(error_kind(f"HTTP {status}", body))

    async def close(self) -> None:
        await super().close()
        for name in self._regions:
            # the server may be gone or have forgotten it: the file goes below either way
            with contextlib.suppress(ApplianceError):
                await self.admin.post(f"/v2/systemsharedmemory/region/{name}/unregister")
        await self.admin.close()
        for path in self._files:
            path.unlink(missing_ok=True)


class GrpcTransport(Transport):
    """KServe v2 gRPC; requests serialized once, replies checked by status only."""

    name = "grpc"

    def __init__(self, url: str, model: str, version: str = "", token: str = "") -> None:
        self.url, self.model, self.version = url, model, version
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._requests: list[bytes] = []

    async def open(self, samples: Samples, slots: int) -> None:
        problem = grpc_libraries.load_error()  # the other transports need no grpcio
        if problem is not None:
            raise invalid(f"-i grpc needs the gRPC libraries ({problem}): {grpc_libraries.FIX}")
        import grpc
        from tritonclient.grpc import service_pb2

        self._grpc = grpc
        host, port = split_url(self.url, 8001)
        for sample in samples:
            msg = service_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
            for n, arr in sample.items():
                t = msg.inputs.add(name=n, datatype=from_numpy_dtype(arr.dtype))
                t.shape.extend(arr.shape)
                msg.raw_input_contents.append(bytes(to_raw(arr)))
            self._requests.append(msg.SerializeToString())
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(f"{host}:{port}", options=options)
        # bytes in, bytes out: no protobuf work per request on the client
        self._call = self._channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    async def infer(self, sample: int, slot: int) -> None:
        try:
            await self._call(self._requests[sample], metadata=self.metadata)
        except self._grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"gRPC {exc.code().name}: {(exc.details() or '')[:100]}") from None

    async def close(self) -> None:
        if hasattr(self, "_channel"):
            await self._channel.close()


class MqttTransport(Transport):
    """The appliance's MQTT bridge: binary-extension requests, MQTT v5 request/response."""

    name = "mqtt"

    def __init__(self, broker: str, model: str, prefix: str, device: str) -> None:
        self.host, self.port = split_url(broker, 1883)
        self.topic = f"{prefix}/{device}/infer/{model}"
        self.reply_topic = f"{prefix}/perf-replies/{os.getpid()}"
        self._pending: dict[bytes, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    async def open(self, samples: Samples, slots: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._props_type, self._packet = Properties, PacketTypes.PUBLISH
        self._loop = asyncio.get_running_loop()
        self._bodies = [binary_body(s) for s in samples]
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"appliance-perf-{os.getpid()}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        subscribed: asyncio.Future[None] = self._loop.create_future()
        client.on_message = self._on_reply

        def on_subscribe(*_: Any) -> None:
            self._loop.call_soon_threadsafe(_settle, subscribed, "")

        client.on_subscribe = on_subscribe
        client.on_connect = lambda c, *a: c.subscribe(self.reply_topic, qos=1)
        # without it Nagle's algorithm holds small publishes back for tens of ms
        client.on_socket_open = _no_delay
        try:
            client.connect(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise ApplianceError(
                Code.UNAVAILABLE, f"MQTT broker {self.host}:{self.port}: {exc}"
            ) from None
        client.loop_start()
        self.client = client
        await asyncio.wait_for(subscribed, 10)

    def _on_reply(self, client: Any, userdata: object, message: Any) -> None:
        props = message.properties
        corr = getattr(props, "CorrelationData", b"")
        user = dict(getattr(props, "UserProperty", None) or [])
        kind = ""
        if "error-code" in user:
            kind = error_kind(f"MQTT {user['error-code']}", message.payload)
        with self._lock:
            future = self._pending.pop(corr, None)
        if future is not None:
            self._loop.call_soon_threadsafe(_settle, future, kind)

    async def infer(self, sample: int, slot: int) -> None:
        body, header_length = self._bodies[sample]
        corr = b"%d" % next(self._ids)
        props = self._props_type(self._packet)  # type: ignore[no-untyped-call]
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = corr
        props.UserProperty = (HEADER_LENGTH, str(header_length))
        future = self._loop.create_future()
        with self._lock:
            self._pending[corr] = future
        self.client.publish(self.topic, body, qos=1, properties=props)
        try:
            await asyncio.wait_for(future, MQTT_REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestFailed(f"MQTT: no reply within {MQTT_REPLY_TIMEOUT_S:g} s") from None
        finally:
            with self._lock:
                self._pending.pop(corr, None)

    async def close(self) -> None:
        if hasattr(self, "client"):
            self.client.disconnect()
            self.client.loop_stop()


def _no_delay(client: Any, userdata: Any, sock: Any) -> None:
    with contextlib.suppress(OSError, AttributeError):  # e.g. a websocket transport
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _settle(future: asyncio.Future[None], kind: str) -> None:
    if future.done():
        return
    if kind:
        future.set_exception(RequestFailed(kind))
    else:
        future.set_result(None)


class InProcessTransport(Transport):
    """The in-process API: the same data plane without sockets (the ceiling of the
    server itself, with this process's load generator in front)."""

    name = "inprocess"

    def __init__(self, server: Any, model: str, version: str = "") -> None:
        self.server, self.model, self.version = server, model, version

    async def open(self, samples: Samples, slots: int) -> None:
        self._samples = [dict(s) for s in samples]

    async def infer(self, sample: int, slot: int) -> None:
        try:
            await self.server.infer(self.model, self._samples[sample], version=self.version)
        except ApplianceError as exc:
            raise RequestFailed(f"{exc.code.name}: {exc.message[:100]}") from None
