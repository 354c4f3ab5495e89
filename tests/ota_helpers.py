"""OTA test parts: a static HTTP server with Range support, a fleet repository, bundles.

All real: the server is ``http.server`` on 127.0.0.1 in a thread; repositories are
signed with real ed25519 keys through python-tuf's Metadata API.
"""

from __future__ import annotations

import http.server
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools import modelgen
from ota import bundle, keys, repo
from ota.config import OtaConfig
from ota.rollout import Rollout


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range ``Range: bytes=N-`` support; can cut a transfer."""

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
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
            start = int(rng[6:].rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.server.cut_after
        if cut and path.suffix == ".bundle":
            self.server.cut_after = 0  # once
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


class StaticServer(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # a fleet's devices connect at once (benchmarks/bench_fleet.py)
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self.cut_after = 0
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

    def bundle(self, version: int, delta: int = 0, memory: int = 0) -> Path:
        folder = modelgen.write_model(
            self.src, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, version
        )
        out = self.root / f"simple-{version}.bundle"
        bundle.build(folder, version, out, memory_bytes=memory, self_test=vectors(delta))
        return out

    def publish(self, version: int, delta: int = 0, percent: float = 100, memory: int = 0) -> Path:
        path = self.bundle(version, delta, memory)
        repo.publish(self.repo, self.keys, path, Rollout(percent=percent))
        return path

    def device(self, state: Path, models: Path, server_url: str, **kw: Any) -> OtaConfig:
        options: dict[str, Any] = {
            "probation_s": 0.3,
            "probation_poll_s": 0.1,
            "check_interval_s": 1.0,
            # latency is not compared in tests: a shared CI machine makes it noise
            "max_latency_ratio": 0.0,
        }
        options.update(kw)
        return OtaConfig(
            source=self.server.url,
            trusted_root=self.repo / "metadata" / "1.root.json",
            state_dir=state,
            server=server_url,
            model_repository=models,
            device_id=options.pop("device_id", "cam-1"),
            **options,
        )


def start_fleet(root: Path) -> Fleet:
    root.mkdir(parents=True, exist_ok=True)
    (root / "repo").mkdir(exist_ok=True)
    server = StaticServer(root / "repo")
    return Fleet(root, server)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


__all__ = ["Fleet", "StaticServer", "files_under", "os", "start_fleet", "vectors"]
