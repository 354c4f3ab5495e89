"""Per-model process isolation, the server side: ``parameters: {execution: process}``.

:func:`create` is how the model layer builds every instance: in the server process
(the default, ``execution: in_process``), or as a :class:`ProcessBackend` that runs
the backend (any of them: Python models, ONNX Runtime, ...) in a worker process of
its own (:mod:`appliance.backends.process_worker`), the way Triton's Python backend runs a
stub process per instance. Tensors cross in one shared-memory segment per
instance, reused across requests; a Unix socket carries the small control frames
(:mod:`appliance.backends.process_ipc`).

The worker is a fresh interpreter started with ``subprocess`` (fork+exec at once,
as multiprocessing's ``spawn`` does): the threaded server is never forked and
carries on. ``ProcessBackend`` is driven by its instance's one thread like any
backend, so it needs no locks.

Failure policy, per instance:

- The worker dies (segfault, ``os._exit``, OOM kill): the batch in flight fails
  with INTERNAL "model instance process died: signal 11 (SIGSEGV)" and a new
  worker is started at once; the next batch waits for it to be ready.
- ``execute_timeout_s`` (optional): a call still running after that is ended by
  killing the worker (UNAVAILABLE), which is restarted the same way.
- Consecutive failures (deaths, timeouts, failed restarts; a success resets the
  count) back off: the 2nd waits ``process_restart_backoff_s`` (0.5 s), doubling
  up to 30 s; batches in that window fail fast with UNAVAILABLE. After
  ``process_max_failures`` (5) in a row the instance gives up: ``healthy`` turns
  False (the model reports not ready) until the model is loaded again, which the
  lifecycle does itself, with back-off (:mod:`appliance.core.recovery`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from appliance import backends
from appliance.backends.base import Backend, BackendOptions, MemoryUsage
from appliance.backends.parameters import Parameters
from appliance.backends.process_ipc import (
    ChannelClosed,
    Segment,
    create_segment_fd,
    error_from_frame,
    options_to_wire,
    read_tensors,
    recv_frame,
    send_frame,
    specs_from_wire,
    write_tensors,
)
from appliance.config.fields import ConfigError
from appliance.decoupled import CancelFlag, cancel_of, parameters_of
from appliance.errors import ApplianceError, Code, FailureReason, internal, unavailable

log = logging.getLogger(__name__)

MODES = ("in_process", "process")
POLL_S = 0.5  # how often a waiting call checks that its worker still runs
INITIAL_SEGMENT = 2**20
KEEP_SEGMENT = 8 * 2**20  # pages beyond this are handed back after a larger request
MAX_BACKOFF_S = 30.0
# host-side settings: the worker never sees them
_HOST_KEYS = (
    "execution",
    "execute_timeout_s",
    "process_max_failures",
    "process_restart_backoff_s",
    "process_start_timeout_s",
)


def execution_mode(parameters: dict[str, str], model: str) -> str:
    """``in_process`` or ``process``, from the model config's ``execution`` parameter."""
    return Parameters(model, parameters).choice(("execution",), MODES, "in_process")


def create(name: str, options: BackendOptions) -> Backend:
    """One instance of backend ``name``, in this process or in a worker process."""
    if execution_mode(options.parameters, options.model_name) == "process":
        return ProcessBackend(name, options)
    return backends.create(name, options)


@dataclass(frozen=True, slots=True)
class _Settings:
    max_failures: int
    backoff_s: float
    start_timeout_s: float
    execute_timeout_s: float | None

    @classmethod
    def read(cls, options: BackendOptions) -> _Settings:
        params = options.parameters

        def seconds(key: str, default: float | None) -> float | None:
            if key not in params:
                return default
            try:
                value = float(params[key])
            except ValueError:
                value = -1.0
            if not value > 0 or value == float("inf"):
                raise ConfigError(
                    options.config_source,
                    f"parameters.{key}",
                    f"expected a number of seconds > 0, got {params[key]!r}",
                )
            return value

        count = Parameters(options.model_name, params).integer(
            ("process_max_failures",), 5, minimum=1
        )
        return cls(
            count,
            seconds("process_restart_backoff_s", 0.5) or 0.5,
            seconds("process_start_timeout_s", 120.0) or 120.0,
            seconds("execute_timeout_s", None),
        )


class _Died(Exception):
    """The worker is gone (its socket closed or its process exited)."""


class _TimedOut(Exception):
    pass


class _Garbled(Exception):
    """The worker answered something that is not a valid frame."""


@dataclass(slots=True)
class _Worker:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    segment: Segment


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _gone(worker: _Worker) -> bool:
    """The idle worker has exited, or is exiting: its end of the socket is closed
    (the kernel closes a dying process's files before it can be waited for)."""
    if worker.proc.poll() is not None:
        return True
    try:
        readable, _, _ = select.select([worker.sock], [], [], 0)
        return bool(readable) and worker.sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class ProcessBackend:
    """One model instance whose backend runs in a worker process; see the module doc."""

    def __init__(self, backend: str, options: BackendOptions) -> None:
        self._name = options.model_name
        self._where = f"model '{self._name}' instance {options.instance_index}"
        self._settings = _Settings.read(options)
        declared = json.loads(options.model_config or "{}")
        if declared.get("model_transaction_policy", {}).get("decoupled"):
            raise ConfigError(
                options.config_source,
                "parameters.execution",
                "process isolation does not support decoupled models",
            )
        # the model's folder: all it may load, and the worker's working directory (so a
        # path relative to the server's own, e.g. --model-repository models, is made
        # absolute first; options_to_wire does the same for the model file)
        self._root = options.model_path.parent.parent.absolute()
        package_root = str(Path(backends.__file__).resolve().parents[2])
        self._env = dict(os.environ)
        self._env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p
        )
        self._init = {
            "op": "init",
            "backend": backend,
            "root": str(self._root),
            "options": options_to_wire(options, drop=_HOST_KEYS),
        }
        self._worker: _Worker | None = None
        self._starting = False  # init sent, its answer not read yet
        self._failures = 0  # consecutive
        self._retry_at = 0.0
        self.healthy = True  # False once the instance gave up (crash loop)
        # a Python model reads its request's parameters and cancel flag: they cross too
        self.request_context = backend == "python"
        self._spawn()
        try:
            reply = self._await_start()
        except _Died:
            how = _how_it_ended(self._discard(wait_s=10) or 0)
            raise internal(f"{self._where}: the worker process died while loading: {how}") from None
        except (_TimedOut, _Garbled) as exc:
            self._discard(wait_s=0)
            raise internal(f"{self._where}: the worker process failed to start: {exc}") from None
        except BaseException:
            self._discard()
            raise
        try:
            self.inputs = specs_from_wire(reply.get("inputs"))
            self.outputs = specs_from_wire(reply.get("outputs"))
        except ValueError as exc:
            self._discard(wait_s=0)
            raise internal(f"{self._where}: the worker sent bad tensor specs: {exc}") from None
        limit = reply.get("max_batch_size")
        self.max_batch_size = limit if isinstance(limit, int) and limit > 0 else 0

    # ---- the worker's life ---------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id (None while it is down)."""
        return self._worker.proc.pid if self._worker is not None else None

    def _spawn(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        segment = Segment(create_segment_fd(INITIAL_SEGMENT), INITIAL_SEGMENT)
        command = [sys.executable, "-m", "appliance.backends.process_worker"]
        args = [child.fileno(), segment.fd, segment.size, os.getpid()]
        try:
            proc = subprocess.Popen(
                command + [str(a) for a in args],
                pass_fds=(child.fileno(), segment.fd),
                cwd=self._root,
                env=self._env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            segment.close()
            raise
        finally:
            child.close()
        parent.settimeout(POLL_S)
        self._worker = _Worker(proc, parent, segment)
        self._starting = True
        with contextlib.suppress(OSError):  # it died already: _await_start reports how
            send_frame(parent, self._init)

    def _recv(self, deadline: float | None, cancel: CancelFlag | None = None) -> dict[str, Any]:
        worker = self._worker
        assert worker is not None
        told = False

        def idle() -> None:
            nonlocal told
            if worker.proc.poll() is not None:
                raise _Died
            if deadline is not None and time.monotonic() > deadline:
                raise _TimedOut("no answer in time")
            if cancel is not None and not told and cancel.is_set():
                told = True  # the caller went away: the model's is_cancelled() turns True
                send_frame(worker.sock, {"op": "cancel"})

        try:
            return recv_frame(worker.sock, idle)
        except ChannelClosed:
            raise _Died from None
        except ValueError as exc:
            raise _Garbled(str(exc)) from None

    def _await_start(self) -> dict[str, Any]:
        """The worker's answer to ``init``; raises the error it reported."""
        reply = self._recv(time.monotonic() + self._settings.start_timeout_s)
        self._starting = False
        if reply.get("ok") is not True:
            self._discard()
            raise error_from_frame(reply)
        return reply

    def _discard(self, wait_s: float = 2.0) -> int | None:
        """End the worker: give it ``wait_s`` seconds to exit by itself (0: kill it at
        once), then reap it and close its channels; returns its exit status."""
        worker, self._worker, self._starting = self._worker, None, False
        if worker is None:
            return None
        try:
            worker.proc.wait(timeout=wait_s) if wait_s else worker.proc.kill()
        except subprocess.TimeoutExpired:
            worker.proc.kill()
        returncode = worker.proc.wait()  # reaped: never a zombie
        worker.sock.close()
        worker.segment.close()
        return returncode

    def _lost(self, why: str, code: Code = Code.INTERNAL) -> ApplianceError:
        """Count one failure, schedule the restart (or give up); the batch's error."""
        self._failures += 1
        if self._failures >= self._settings.max_failures:
            self.healthy = False
            then = (
                f"; gave up after {self._failures} consecutive failures: "
                "the model is not ready until it is loaded again (the server loads it "
                "again itself, with back-off)"
            )
        else:
            delay = 0.0
            if self._failures > 1:
                delay = min(MAX_BACKOFF_S, self._settings.backoff_s * 2 ** (self._failures - 2))
            self._retry_at = time.monotonic() + delay
            then = "; it is being restarted" if delay == 0 else f"; restarting in {delay:g}s"
            if delay == 0:
                try:
                    self._spawn()  # at once: the next batch only waits for it to be ready
                except OSError:
                    self._worker = None
        error = ApplianceError(code, f"{self._where}: {why}{then}", FailureReason.BACKEND)
        log.warning("%s", error.message)
        return error

    def _died(self) -> ApplianceError:
        # its socket closed: it is exiting, which a loaded device may take seconds to
        # finish; killing it sooner would report SIGKILL instead of what killed it
        returncode = self._discard(wait_s=10)
        how = _how_it_ended(returncode) if returncode is not None else "unknown"
        return self._lost(f"model instance process died: {how}")

    def _ensure_started(self) -> None:
        worker = self._worker
        if worker is not None and not self._starting and _gone(worker):
            # it died while idle (an OOM kill, say): nothing was in flight, so this
            # batch is served by its successor when the backoff allows
            self._died()
        if not self.healthy:
            raise unavailable(
                f"{self._where}: its process failed {self._failures} times in a row; "
                "the model is being loaded again",
                FailureReason.BACKEND,
            )
        if self._worker is None:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                raise unavailable(
                    f"{self._where}: its process is restarted in {wait:.1f}s "
                    f"after {self._failures} consecutive failure(s)",
                    FailureReason.BACKEND,
                )
            try:
                self._spawn()
            except OSError as exc:
                raise self._lost(f"cannot start the model instance process: {exc}") from None
        if self._starting:
            try:
                self._await_start()
            except _Died:
                raise self._died() from None
            except (_TimedOut, _Garbled) as exc:
                self._discard(wait_s=0)
                raise self._lost(f"model instance process failed to restart: {exc}") from None
            except ApplianceError as exc:
                raise self._lost(f"model instance process failed to restart: {exc}") from None

    # ---- the backend protocol ------------------------------------------------------------

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        self._ensure_started()
        worker = self._worker
        assert worker is not None
        segment = worker.segment
        described = write_tensors(segment, inputs, 0)
        timeout = self._settings.execute_timeout_s
        message = {
            "op": "infer",
            "size": segment.size,
            "inputs": described,
            "outputs": outputs,
            "parameters": parameters_of(inputs),
        }
        try:
            send_frame(worker.sock, message)
            reply = self._recv(time.monotonic() + timeout if timeout else None, cancel_of(inputs))
        except (_Died, OSError):
            raise self._died() from None
        except _TimedOut:
            self._discard(wait_s=0)
            raise self._lost(
                f"execute did not finish within {timeout:g}s; its process was killed",
                Code.UNAVAILABLE,
            ) from None
        except _Garbled as exc:
            self._discard(wait_s=0)
            raise self._lost(f"model instance process sent a malformed answer: {exc}") from None
        if reply.get("ok") is not True:
            self._failures = 0  # it answered: the process is sound
            raise error_from_frame(reply)
        try:
            # the file can only grow (sealed against shrinking): map what is really there
            segment.remap(os.fstat(segment.fd).st_size)
            result = read_tensors(segment, reply.get("outputs"), copy=True)
        except (ValueError, ApplianceError) as exc:
            self._discard(wait_s=0)
            raise self._lost(f"model instance process sent malformed outputs: {exc}") from None
        if segment.size > KEEP_SEGMENT and segment.map is not None:
            # hand a large request's pages back; the mapping (and its size) stays
            segment.map.madvise(mmap.MADV_REMOVE, KEEP_SEGMENT, segment.size - KEEP_SEGMENT)
        self._failures = 0
        return result

    def memory_usage(self) -> MemoryUsage:
        """The worker's resident memory (the server's own RSS does not include it)."""
        pid = self.pid
        try:
            with open(f"/proc/{pid}/statm", encoding="ascii") as f:
                resident = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return MemoryUsage()
        return MemoryUsage(cpu_bytes=resident * mmap.PAGESIZE)

    def close(self) -> None:
        worker = self._worker
        if worker is None:
            return
        graceful = False
        if not self._starting:
            try:
                send_frame(worker.sock, {"op": "close"})
                graceful = self._recv(time.monotonic() + 10).get("ok") is True
            except (_Died, _TimedOut, _Garbled, OSError):
                pass
        self._discard(wait_s=10 if graceful else 0)
