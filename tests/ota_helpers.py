"""OTA test parts: a static HTTP server with Range support, a fleet repository, bundles.

All real: the server is ``http.server`` on 127.0.0.1 in a thread; repositories are
signed with real ed25519 keys through python-tuf's Metadata API.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from tuf.api.metadata import TargetFile

from appliance.ota import bundle, keys, repo
from appliance.ota.agent import Agent
from appliance.ota.config import OtaConfig
from appliance.ota.rollout import Rollout
from devtools import modelgen
from tests.mosquitto import Client

BODY = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range ``Range: bytes=N-`` support. Faults a mirror
    has, set on the server: ``cut_after`` (cut one bundle transfer after N bytes),
    ``broken_range`` (answer a Range with 206 but the file from byte 0, as a broken
    cache does), ``trickle`` (send bundles N bytes per 0.1 s), ``lie`` (answer a
    Range with a ``Content-Range`` that promises the rest of the file from N, and
    send: "long", the whole file from byte 0, without a Content-Length; "long-declared",
    the same with its Content-Length; "short", the rest from N + 1000, with its
    Content-Length; "wrong", as many bytes as promised, but from byte 0), ``corrupt``
    (every byte served from byte 0 of a file is flipped at one offset)."""

    server: StaticServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        self.server.requests.append((self.path, self.headers.get("Range", "")))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        if self.server.corrupt and path.suffix == ".bundle":
            data = data[:-10] + bytes(b ^ 0xFF for b in data[-10:])
        start = 0
        rng = self.headers.get("Range", "")
        lie = self.server.lie
        if rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
            start = 0 if self.server.broken_range else int(rng[6:].rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
            lie = ""
        body = data[start:]
        if lie in ("long", "long-declared"):
            body = data
        elif lie == "short":
            body = data[start + 1000 :]
        elif lie == "wrong":
            body = data[: len(data) - start]
        if lie != "long":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.server.cut_after
        if cut and path.suffix == ".bundle":
            self.server.cut_after = 0  # once
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        step = self.server.trickle
        if step and path.suffix == ".bundle":
            for i in range(0, len(body), step):  # bounded: the file's length
                self.wfile.write(body[i : i + step])
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.wfile.write(body)


class StaticServer(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # a fleet's devices connect at once (benchmarks/bench_fleet.py)
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self.cut_after = 0
        self.broken_range = False
        self.trickle = 0
        self.lie = ""
        self.corrupt = False
        super().__init__(("127.0.0.1", 0), self._handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def _handler(self, *args: Any) -> RangeHandler:
        return RangeHandler(*args, directory=str(self.root))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def vectors(delta: int = 0) -> list[dict[str, Any]]:
    """Self-test vectors of the ``simple`` model (``delta`` != 0: wrong expectations)."""
    a = list(range(16))
    return [
        {
            "inputs": {
                "INPUT0": {"datatype": "INT32", "shape": [1, 16], "data": a},
                "INPUT1": {"datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
            },
            "outputs": {
                "OUTPUT0": {
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "data": [x + 1 + delta for x in a],
                },
                "OUTPUT1": {"datatype": "INT32", "shape": [1, 16], "data": [x - 1 for x in a]},
            },
            "tolerance": 0,
        }
    ]


# ``simple`` as a Python model (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1),
# with a behaviour for the probation tests: "ok"; "hang": each loaded copy answers its
# first request, then every later one only after HANG_S; "fail": a request whose
# INPUT0 starts with -1 raises (an execution error, answered 500)
PY_SIMPLE = """
import time

import numpy as np

from appliance import python_model as pb_utils

BEHAVIOUR = {behaviour!r}
HANG_S = {hang_s!r}


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        if BEHAVIOUR == "hang" and self.calls > 1:
            time.sleep(HANG_S)
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if BEHAVIOUR == "fail" and int(a.flat[0]) == -1:
                raise RuntimeError("the model fails on this input")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (a + b).astype(np.int32)),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(np.int32)),
            ]))
        return responses
"""
PY_SIMPLE_CONFIG = modelgen.SIMPLE_CONFIG.replace("backend: onnxruntime", "backend: python")


def write_python_simple(
    src: Path, version: int, behaviour: str = "ok", hang_s: float = 5.0, name: str = "simple"
) -> Path:
    """``src/<name>/<version>/model.py`` and the config; returns the model folder."""
    folder = src / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    source = PY_SIMPLE.format(behaviour=behaviour, hang_s=hang_s)
    (folder / str(version) / "model.py").write_text(source)
    (folder / "config.yaml").write_text(PY_SIMPLE_CONFIG)
    return folder


@dataclass
class Fleet:
    """A signed repository served over HTTP, and a source of bundles."""

    root: Path
    server: StaticServer
    keys: Path = field(init=False)
    repo: Path = field(init=False)
    src: Path = field(init=False)

    def __post_init__(self) -> None:
        self.keys, self.repo, self.src = self.root / "keys", self.root / "repo", self.root / "src"
        keys.generate(self.keys)
        repo.init(self.repo, self.keys)

    def bundle(self, version: int, delta: int = 0, memory: int = 0, pad: int = 0) -> Path:
        """``pad``: that many incompressible bytes more, in a file of the version."""
        folder = modelgen.write_model(
            self.src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, version
        )
        if pad:
            (folder / str(version) / "pad.bin").write_bytes(os.urandom(pad))
        out = self.root / f"simple-{version}.bundle"
        bundle.build(folder, version, out, memory_bytes=memory, self_test=vectors(delta))
        return out

    def publish(
        self, version: int, delta: int = 0, percent: float = 100, memory: int = 0, pad: int = 0
    ) -> Path:
        path = self.bundle(version, delta, memory, pad)
        repo.publish(self.repo, self.keys, path, Rollout(percent=percent))
        return path

    def publish_python(
        self, version: int, behaviour: str = "ok", name: str = "pysimple", **kw: Any
    ) -> Path:
        """A Python ``simple`` (see :data:`PY_SIMPLE`) under ``name``, with vectors."""
        folder = write_python_simple(self.src, version, behaviour, name=name)
        out = self.root / f"{name}-{version}.bundle"
        bundle.build(folder, version, out, self_test=kw.pop("self_test", vectors()), **kw)
        repo.publish(self.repo, self.keys, out, Rollout())
        return out

    def device(self, state: Path, models: Path, server_url: str, **kw: Any) -> OtaConfig:
        options: dict[str, Any] = {
            "probation_s": 0.3,
            "probation_poll_s": 0.1,
            "probation_min_requests": 1,  # the self-test vectors probe at every poll
            "check_interval_s": 1.0,
            # latency is not compared in tests: a shared CI machine makes it noise
            "max_latency_ratio": 0.0,
        }
        options.update(kw)
        return OtaConfig(
            source=options.pop("source", self.server.url),
            trusted_root=self.repo / "metadata" / "1.root.json",
            state_dir=state,
            server=server_url,
            model_repository=models,
            device_id=options.pop("device_id", "cam-1"),
            **options,
        )


class LocalDevice:
    """A real server (explicit model control) and, called, a fresh agent over one state
    folder: a new Agent reads its state from disk only, like a restarted process."""

    def __init__(
        self, fleet: Fleet, models: Path, state: Path, url: str, metrics_url: str = ""
    ) -> None:
        self.fleet, self.models, self.state_dir, self.url = fleet, models, state, url
        self.metrics_url = metrics_url

    def __call__(self, **kw: Any) -> Agent:
        kw.setdefault("metrics_url", self.metrics_url)
        return Agent(self.fleet.device(self.state_dir, self.models, self.url, **kw))

    def serving(self, model: str = "simple") -> str:
        """The version unversioned requests to ``model`` are answered by."""
        url = f"{self.url}/v2/models/{model}/infer"
        r = urllib3.request("POST", url, json=BODY, retries=False)
        assert r.status == 200, r.data
        return str(json.loads(r.data)["model_version"])


def raw_bundle(
    out: Path,
    name: str,
    version: int,
    files: dict[str, bytes],
    config: bytes,
    backend: str = "onnxruntime",
    config_file: str = "config.yaml",
    extra: list[tuple[tarfile.TarInfo, bytes]] | None = None,
) -> Path:
    """A bundle made by hand, as an attacker or an old tool would: a valid manifest for
    ``files``, whatever ``config`` and ``backend`` say, and ``extra`` raw headers with
    their data (possibly less than they declare) before the model's files."""
    manifest = {
        "format": 1, "name": name, "version": version, "backend": backend,
        "config_file": config_file,
        "files": [
            {"path": f, "sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
            for f, d in sorted(files.items())
        ],
        "self_test": [],
    }  # fmt: skip
    members = [("manifest.json", json.dumps(manifest).encode()), (config_file, config)]
    infos = []
    for member, data in members + [(f"model/{f}", d) for f, d in sorted(files.items())]:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        infos.append((info, data))
    infos[2:2] = extra or []  # after the config, before the model's files
    body = b""
    for info, data in infos:  # headers as they are: type and size untouched
        body += info.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)
    out.write_bytes(gzip.compress(body + b"\0" * 1024, compresslevel=1))
    return out


def publish_raw(fleet: Fleet, path: Path, name: str, version: int, backend: str) -> None:
    """Sign ``path`` into the fleet's targets as the fleet tool would, without its
    checks (what a device must withstand)."""
    targets = repo._load(fleet.repo / "metadata", "targets")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    target_path = repo.target_path(name, version)
    target = TargetFile.from_file(target_path, str(path), ["sha256"])
    info = {"name": name, "version": version, "backend": backend,
            "rollout": Rollout().to_json()}  # fmt: skip
    target.unrecognized_fields["custom"] = {"appliance": info}
    folder = fleet.repo / "targets" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{digest}.{name}-{version}.bundle").write_bytes(path.read_bytes())
    targets.signed.targets[target_path] = target
    repo._sign_chain(fleet.repo, fleet.keys, targets, repo.Expiry(), bump=True)


def retained_report(port: int, device: str, prefix: str = "fleet") -> dict[str, Any]:
    """The report ``device`` left retained on the broker at ``port``."""
    watcher = Client(port)
    try:
        watcher.subscribe(f"{prefix}/+/ota")
        (report,) = watcher.collect(1, topic=f"{prefix}/{device}/ota")
    finally:
        watcher.close()
    doc: dict[str, Any] = json.loads(report.payload)
    return doc


def start_fleet(root: Path) -> Fleet:
    root.mkdir(parents=True, exist_ok=True)
    (root / "repo").mkdir(exist_ok=True)
    server = StaticServer(root / "repo")
    return Fleet(root, server)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


__all__ = [
    "BODY", "Fleet", "LocalDevice", "StaticServer", "files_under", "os", "start_fleet", "vectors",
]  # fmt: skip
