"""The Python floor: the least a Python server on this stack can do per request.

    python benchmarks/floor_server.py REPOSITORY --http-port PORT [--threads 1]

A benchmark instrument, not a server to deploy. It loads every ``<model>/1/model.onnx``
under ``REPOSITORY`` into ONNX Runtime (the appliance's session options: ``--threads``
intra-op threads, one inter-op thread, sequential, no spinning) and answers, over
HTTP/1.1 on 127.0.0.1, just what perf_analyzer asks of a KServe server: ready, model
metadata and config, statistics, and inference with the binary tensor extension. Per
request it does only what any server must: find the head's end and its two lengths,
read the JSON inference header (orjson), view each input in the body (``np.frombuffer``,
no copy), run the session on the event loop's thread (uvloop), and write the answer's
JSON header and tensors in one write.

What it leaves out is everything the appliance adds: no validation beyond what keeps
it from crashing, no token, no admission or memory budget, no batching or queue, no
statistics but two counters, no timeouts, no metrics, no gRPC. So its CPU per request
and its start-up are a floor for any design that parses and answers in Python: the
appliance can only approach it, and what separates the floor from native Triton is
the cost of Python itself on this path. ``bench_triton.py --floor`` runs it beside the
other servers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson

DTYPES = {
    "tensor(float)": ("FP32", np.float32, "TYPE_FP32"),
    "tensor(int32)": ("INT32", np.int32, "TYPE_INT32"),
    "tensor(int64)": ("INT64", np.int64, "TYPE_INT64"),
}
BY_NAME = {k: v for _, (k, v, _) in DTYPES.items()}


class Model:
    def __init__(self, name: str, path: Path, threads: int) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.name = name
        self.count = 0
        self.inputs = [(i.name, DTYPES[i.type], i.shape[1:]) for i in self.session.get_inputs()]
        self.outputs = [(o.name, DTYPES[o.type], o.shape[1:]) for o in self.session.get_outputs()]
        tensors = (
            [{"name": n, "datatype": t[0], "shape": [-1, *s]} for n, t, s in self.inputs],
            [{"name": n, "datatype": t[0], "shape": [-1, *s]} for n, t, s in self.outputs],
        )
        self.metadata = orjson.dumps(
            {
                "name": name,
                "versions": ["1"],
                "platform": "onnxruntime_onnx",
                "inputs": tensors[0],
                "outputs": tensors[1],
            }
        )
        config = {
            "name": name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "max_batch_size": 8,
            "input": [{"name": n, "data_type": t[2], "dims": s} for n, t, s in self.inputs],
            "output": [{"name": n, "data_type": t[2], "dims": s} for n, t, s in self.outputs],
        }
        self.config = orjson.dumps(config)

    def stats(self) -> bytes:
        c = {"count": self.count, "ns": 0}
        return orjson.dumps(
            {
                "model_stats": [
                    {
                        "name": self.name,
                        "version": "1",
                        "inference_count": self.count,
                        "execution_count": self.count,
                        "inference_stats": {"success": c},
                    }
                ]
            }
        )

    def infer(self, body: bytes, header_length: int) -> tuple[bytes, int]:
        """The answer's body and its JSON header's length."""
        header = orjson.loads(body[:header_length])
        feeds: dict[str, Any] = {}
        offset = header_length
        for spec in header["inputs"]:
            dtype = BY_NAME[spec["datatype"]]
            size = spec["parameters"]["binary_data_size"]
            array = np.frombuffer(body, dtype, size // dtype().itemsize, offset)
            feeds[spec["name"]] = array.reshape(spec["shape"])
            offset += size
        results = self.session.run(None, feeds)
        self.count += 1
        outputs = [
            {
                "name": n,
                "datatype": t[0],
                "shape": list(r.shape),
                "parameters": {"binary_data_size": r.nbytes},
            }
            for (n, t, _), r in zip(self.outputs, results, strict=True)
        ]
        answer = orjson.dumps({"model_name": self.name, "model_version": "1", "outputs": outputs})
        return b"".join([answer, *(r.tobytes() for r in results)]), len(answer)


def response(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"".join(
        [
            b"HTTP/1.1 ",
            status,
            b"\r\nContent-Type: application/json\r\n",
            extra,
            b"Content-Length: ",
            str(len(body)).encode(),
            b"\r\n\r\n",
            body,
        ]
    )


def header_value(head: bytes, name: bytes) -> int | None:
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    return int(head[start : head.index(b"\r\n", start)])


class Floor(asyncio.Protocol):
    def __init__(self, models: dict[str, Model]) -> None:
        self.models = models
        self.buffer = bytearray()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[: end + 2]).lower()
            length = header_value(head, b"content-length") or 0
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.transport.write(self.answer(head, body))

    def answer(self, head: bytes, body: bytes) -> bytes:
        line = head[: head.index(b"\r\n")].split(b" ")
        path = line[1].decode().split("/")  # ['', 'v2', 'models', m, ...]
        if path[1:4] == ["v2", "health", "ready"] or path[1:] == ["v2", "health", "live"]:
            return response(b"200 OK", b"")
        if path[1:] == ["v2"]:
            return response(b"200 OK", b'{"name":"floor","version":"0","extensions":[]}')
        model = self.models.get(path[3]) if len(path) > 3 and path[2] == "models" else None
        if model is None:
            return response(b"404 Not Found", b'{"error":"not found"}')
        tail = path[4:]
        if tail and tail[0] == "versions":
            tail = tail[2:]
        if not tail:
            return response(b"200 OK", model.metadata)
        if tail == ["config"]:
            return response(b"200 OK", model.config)
        if tail == ["stats"]:
            return response(b"200 OK", model.stats())
        if tail == ["ready"]:
            return response(b"200 OK", b"")
        header_length = header_value(head, b"inference-header-content-length")
        if tail != ["infer"] or line[0] != b"post" or header_length is None:
            return response(b"400 Bad Request", b'{"error":"binary KServe inference only"}')
        out, json_length = model.infer(body, header_length)
        extra = b"Inference-Header-Content-Length: %d\r\n" % json_length
        return response(b"200 OK", out, extra)


async def serve(repository: Path, port: int, threads: int) -> None:
    models = {
        d.name: Model(d.name, d / "1" / "model.onnx", threads)
        for d in sorted(repository.iterdir())
        if (d / "1" / "model.onnx").is_file()
    }
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Floor(models), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("repository", type=Path)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import uvloop

    uvloop.run(serve(args.repository, args.http_port, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
