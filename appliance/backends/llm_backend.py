"""The ``llm`` backend: a language model served by OpenVINO GenAI's continuous batching.

One instance is one engine process (:mod:`appliance.backends.llm_worker`) holding the model
and its KV cache; every request of the instance goes into that one pipeline, so
concurrent requests share the weights and the cache and are generated together, a
token of each per step, instead of queueing one after another.

The model is decoupled (0..N responses a request, as Triton's vLLM backend):
``infer`` hands the request to the engine and returns at once, and a reader thread
puts each step's text into the request's :class:`~appliance.decoupled.ResponseStream`.

Tensors (the names of Triton's vLLM backend, so its clients and the generate
extension work unchanged):

- in: ``text_input`` (BYTES [1]) or ``messages`` (BYTES [1], a JSON list of
  ``{"role", "content"}`` put through the model's own chat template), and ``stop``
  (BYTES [-1], optional: strings that end the generation, left out of the text);
- out: ``text_output`` (BYTES [1]), ``finish_reason`` (BYTES [1]: ``""`` until the
  last response, then ``stop``, ``length`` or ``cancelled``), ``num_input_tokens``
  and ``num_output_tokens`` (INT32 [1], so far).

Sampling comes from the request's parameters: ``max_tokens``, ``temperature`` (0:
greedy, the default), ``top_p``, ``top_k``, ``seed``, ``ignore_eos``, and ``stream``
(true: a response per step with the new text; false, the default: one response with
all of it).

Cancellation: when the caller goes away the stream's cancel callback tells the
engine, which drops the request from the batch at its next step.

Memory: the engine process's resident memory after its warm-up plus its whole KV
cache (a cache sized in GiB is reserved but filled as needed) is what
:meth:`memory_usage` reports to the budget.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from appliance import decoupled
from appliance.backends import llm_settings
from appliance.backends.base import BackendOptions, MemoryUsage, TensorSpec, check_inputs
from appliance.backends.llm_worker import REFUSED, read_frame, write_frame
from appliance.errors import FailureReason, internal, invalid, unavailable

log = logging.getLogger(__name__)

INPUTS = [
    TensorSpec("text_input", "BYTES", (1,), optional=True),
    TensorSpec("messages", "BYTES", (1,), optional=True),
    TensorSpec("stop", "BYTES", (-1,), optional=True),
]
OUTPUTS = [
    TensorSpec("text_output", "BYTES", (1,)),
    TensorSpec("finish_reason", "BYTES", (1,)),
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
]
START_TIMEOUT_S = 600.0  # loading and compiling a big model on a small CPU
DRAIN_S = 30.0  # how long close() lets running requests finish
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stream")


@dataclass(slots=True)
class _Request:
    stream: decoupled.ResponseStream
    streaming: bool
    outputs: tuple[str, ...]
    text: list[str]
    output_tokens: int = 0


class LlmBackend:
    decoupled = True

    def __init__(self, options: BackendOptions) -> None:
        self._name = options.model_name
        self.settings = llm_settings.read(
            self._name,
            options.model_path.absolute(),
            options.parameters,
            options.kind,
            options.threads,
            options.config_source,
        )
        self.inputs = list(INPUTS)
        self.outputs = list(OUTPUTS)
        self._weights = llm_settings.weights_bytes(options.model_path)
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._lock = threading.Lock()  # the requests table and writes to the engine
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p
        )
        self._ended = False  # the engine's answers ended (set by the reader)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "appliance.backends.llm_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to, self._from = self._proc.stdin, self._proc.stdout
        try:
            write_frame(self._to, self.settings.wire())
            started, _, _ = select.select([self._from], [], [], START_TIMEOUT_S)
            if started:
                ready = read_frame(self._from)
            else:
                ready = {"op": "failed", "error": f"not ready within {START_TIMEOUT_S:g} s"}
        except OSError as exc:
            ready = {"op": "failed", "error": str(exc)}
        if ready is None or ready.get("op") != "ready":
            self._proc.kill()
            self._proc.wait()
            why = ready.get("error", "") if ready else f"exit status {self._proc.returncode}"
            raise invalid(f"model '{self._name}': the LLM engine could not load it: {why}")
        self.kv_bytes = int(ready["kv_bytes"]) or self.settings.kv_cache_gib * llm_settings.GiB
        self._reader = threading.Thread(target=self._read, name=f"llm-{self._name}", daemon=True)
        self._reader.start()

    # ---- requests ----------------------------------------------------------------------

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        check_inputs(self._name, self.inputs, inputs)
        stream = decoupled.stream_of(inputs, self._name)
        frame = self._frame(inputs, decoupled.parameters_of(inputs))
        streaming = bool(frame.pop("stream"))
        job_id = next(self._ids)
        frame["id"] = job_id
        request = _Request(stream, streaming, tuple(outputs), [])
        with self._lock:
            if self._ended or self._proc.poll() is not None:
                raise unavailable(f"model '{self._name}': the LLM engine stopped")
            self._requests[job_id] = request
            try:
                write_frame(self._to, frame)
            except OSError as exc:
                del self._requests[job_id]
                raise unavailable(f"model '{self._name}': the LLM engine stopped: {exc}") from None
        stream.on_cancel(lambda: self._cancel(job_id))
        # placeholders: every response travels through the stream
        return {n: np.empty(0) for n in outputs}

    def _frame(self, inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, Any]:
        """The engine's request: the prompt or chat, and the sampling settings checked."""
        where = f"model '{self._name}'"
        text, chat = inputs.get("text_input"), inputs.get("messages")
        if (text is None) == (chat is None):
            raise invalid(f"{where}: send exactly one of the inputs 'text_input' and 'messages'")
        frame: dict[str, Any] = {"op": "add"}
        if text is not None:
            frame["prompt"] = _text(text, "text_input", where)
        elif chat is not None:
            frame["messages"] = _messages(_text(chat, "messages", where), where)
        config: dict[str, Any] = {}
        limit = self.settings.max_tokens_limit
        tokens = _number(params, "max_tokens", int, self.settings.max_tokens, where)
        if not 1 <= tokens <= limit:
            raise invalid(f"{where}: 'max_tokens' must be between 1 and {limit}, got {tokens}")
        config["max_tokens"] = tokens
        temperature = _number(params, "temperature", float, 0.0, where)
        if not 0.0 <= temperature <= 2.0:
            raise invalid(f"{where}: 'temperature' must be between 0 and 2, got {temperature}")
        config["temperature"] = temperature
        top_p = _number(params, "top_p", float, 1.0, where)
        if not 0.0 < top_p <= 1.0:
            raise invalid(f"{where}: 'top_p' must be in (0, 1], got {top_p}")
        config["top_p"] = top_p
        config["top_k"] = _number(params, "top_k", int, 0, where)
        if "seed" in params:
            seed = _number(params, "seed", int, 0, where)
            if not 0 <= seed < 2**63:
                raise invalid(f"{where}: 'seed' must be a non-negative 64-bit integer")
            config["seed"] = seed
        config["ignore_eos"] = _flag(params, "ignore_eos", where)
        stops = inputs.get("stop")
        if stops is not None:
            if stops.size > 4:
                raise invalid(f"{where}: at most 4 'stop' strings, got {stops.size}")
            config["stop"] = [_decode(s, "stop", where) for s in stops.reshape(-1)]
        frame["config"] = config
        frame["stream"] = _flag(params, "stream", where)
        return frame

    def _cancel(self, job_id: int) -> None:
        with self._lock:
            if job_id not in self._requests or self._ended or self._proc.poll() is not None:
                return
            with contextlib.suppress(OSError):  # gone: the reader fails the request
                write_frame(self._to, {"op": "cancel", "id": job_id})

    # ---- answers -----------------------------------------------------------------------

    def _read(self) -> None:
        """The engine's steps -> the requests' streams, until the engine ends."""
        try:
            while (frame := read_frame(self._from)) is not None:
                for job_id, text, new, prompt, finish, error in frame["items"]:
                    self._deliver(job_id, text, new, prompt, finish, error)
        except (OSError, ValueError) as exc:
            log.warning("model '%s': reading the LLM engine failed: %s", self._name, exc)
        with self._lock:
            # unhealthy before any request hears of it: its pipe can close a moment
            # before the process can be reaped
            self._ended = True
            left, self._requests = self._requests, {}
        for request in left.values():
            request.stream.fail(unavailable(f"model '{self._name}': the LLM engine stopped"))

    def _deliver(
        self, job_id: int, text: str, new: int, prompt: int, finish: str, error: str
    ) -> None:
        with self._lock:
            request = self._requests.get(job_id)
            if request is not None and (finish or error):
                del self._requests[job_id]
        if request is None:
            return
        if error:
            refused = error.removeprefix(REFUSED)
            request.stream.fail(
                invalid(f"model '{self._name}': {refused}")
                if refused != error
                else internal(f"model '{self._name}': {error}", FailureReason.BACKEND)
            )
            return
        request.stream.count_tokens(new, prompt)
        request.output_tokens += new
        final = bool(finish)
        if not request.streaming:
            request.text.append(text)
            if not final:
                return
            text = "".join(request.text)
        elif not text and not final:
            return
        outputs = {
            "text_output": np.array([text.encode()], dtype=np.object_),
            "finish_reason": np.array([finish.encode()], dtype=np.object_),
            "num_input_tokens": np.array([prompt], dtype=np.int32),
            "num_output_tokens": np.array([request.output_tokens], dtype=np.int32),
        }
        if request.outputs:
            outputs = {n: outputs[n] for n in request.outputs if n in outputs}
        request.stream.put(outputs, final)

    # ---- memory and life ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False once the engine process ended: the model reports not ready."""
        return not self._ended and self._proc.poll() is None

    def memory_usage(self) -> MemoryUsage:
        """The engine process's resident memory plus its whole KV cache."""
        return MemoryUsage(cpu_bytes=max(_rss(self._proc.pid), self._weights) + self.kv_bytes)

    def close(self) -> None:
        """Let running requests finish (at most :data:`DRAIN_S`), then end the engine;
        any request still running fails UNAVAILABLE."""
        deadline = time.monotonic() + DRAIN_S
        while self._requests and time.monotonic() < deadline and self._proc.poll() is None:
            time.sleep(0.05)
        with self._lock, contextlib.suppress(OSError):
            self._to.close()  # the engine's stdin ends: it exits
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)
        self._from.close()


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _decode(value: Any, name: str, where: str) -> str:
    try:
        return value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise invalid(f"{where}: input '{name}' is not UTF-8 text") from None


def _text(arr: np.ndarray, name: str, where: str) -> str:
    if arr.size != 1:
        raise invalid(f"{where}: input '{name}' must hold one string, got {arr.size}")
    return _decode(arr.reshape(-1)[0], name, where)


def _messages(raw: str, where: str) -> list[dict[str, str]]:
    try:
        messages = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"{where}: input 'messages' is not JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise invalid(f"{where}: input 'messages' must be a non-empty JSON list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"{where}: messages[{i}] needs a 'role' string")
        content = m.get("content")
        if not isinstance(content, str):
            raise invalid(f"{where}: messages[{i}]: 'content' must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def _number(params: dict[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"{where}: parameter '{key}' must be a number, got {value!r}")
    try:
        number = kind(value)
    except ValueError:
        raise invalid(f"{where}: parameter '{key}' must be a number, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise invalid(f"{where}: parameter '{key}' must be an integer, got {value!r}")
    return number


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise invalid(f"{where}: parameter '{key}' must be true or false, got {value!r}")
    return value
