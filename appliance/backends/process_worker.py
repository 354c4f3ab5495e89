"""The worker process of an isolated model instance (``parameters: {execution: process}``).

Started by :mod:`appliance.backends.process_host` as a fresh interpreter (``python -m
backends.process_worker SOCKET_FD SEGMENT_FD SEGMENT_SIZE PARENT_PID``), never
forked from the threaded server. It hosts one instance of any backend by name
and answers the server's control frames (see :mod:`appliance.backends.process_ipc`):
``init`` (load the model), ``infer`` (tensors in the shared segment, the request's
parameters), ``cancel`` (the caller of the running request went away: a reader thread
sets its flag, which a Python model's ``is_cancelled()`` reads), ``close``.

Confinement: the process inherits only its two channels (every other descriptor
of the server is closed at exec), runs in the model's folder, and refuses a model
file outside the model folder it was given; nothing of the server's configuration
(tokens, TLS keys) is sent to it. It makes no core dumps, ignores Ctrl-C (the
server stops it), and exits when the server goes away: at EOF on its socket, or
when its parent changes (checked every second, for a model call that never
returns).
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from appliance import backends, heap
from appliance.backends.base import Backend, BackendOptions, batch_limit
from appliance.backends.process_ipc import (
    ChannelClosed,
    Segment,
    error_frame,
    options_from_wire,
    read_tensors,
    recv_frame,
    send_frame,
    specs_to_wire,
    write_tensors,
)
from appliance.decoupled import CancelFlag, RequestInputs
from appliance.errors import invalid


def _orphan_watch(parent: int) -> None:
    """Exit when the server is gone, even while a model call blocks the main thread."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _options(message: dict[str, Any]) -> tuple[str, BackendOptions]:
    """The backend name and options of an ``init`` frame, confined to its model folder."""
    root = Path(message["root"]).resolve()
    model_path = Path(message["options"]["model_path"])
    if not model_path.resolve().is_relative_to(root):
        raise invalid(f"model file {model_path} is outside the model folder {root}")
    return str(message["backend"]), options_from_wire(message["options"])


def _read(sock: socket.socket, work: queue.SimpleQueue[dict[str, Any] | None]) -> None:
    """The reader thread: ``infer`` and ``close`` frames to the main thread, in order;
    a ``cancel`` frame sets the cancel flag of the request running now (the server
    sends one only while it waits for that request's answer)."""
    while True:
        try:
            message = recv_frame(sock)
        except (ChannelClosed, ValueError, OSError):
            work.put(None)
            return
        if message.get("op") == "cancel":
            flag = _running.get("cancel")
            if flag is not None:
                flag.set()
            continue
        if message.get("op") == "infer":
            _running["cancel"] = CancelFlag()  # before the main thread sees the request
        work.put(message)
        if message.get("op") == "close":
            return


_running: dict[str, CancelFlag] = {}  # the cancel flag of the request running now


def _serve(sock: socket.socket, segment: Segment, backend: Backend) -> None:
    work: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    threading.Thread(target=_read, args=(sock, work), daemon=True).start()
    while (message := work.get()) is not None:
        if message.get("op") == "close":
            backend.close()
            send_frame(sock, {"ok": True})
            return
        try:
            segment.remap(int(message["size"]))
            views = read_tensors(segment, message["inputs"], copy=False)
            parameters = message.get("parameters")
            inputs = RequestInputs(
                views,
                None,
                parameters if isinstance(parameters, dict) else {},
                _running.get("cancel"),
            )
            del views
            end = max((d[3] + d[4] for d in message["inputs"]), default=0)
            outputs = backend.infer(inputs, [str(n) for n in message["outputs"]])
            del inputs  # views of the segment: valid during this call only
            described = write_tensors(segment, outputs, end)
            del outputs
            reply = {"ok": True, "size": segment.size, "outputs": described}
        except Exception as exc:  # reported to the server; this process keeps serving
            reply = error_frame(exc)
        send_frame(sock, reply)


def main(argv: list[str]) -> int:
    sock_fd, seg_fd, seg_size, parent = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not fill the disk
    # the server's tree and current folder are no import path for model code
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    sock = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock_fd, False)  # a child of the model must not hold it open
    os.set_inheritable(seg_fd, False)
    segment = Segment(seg_fd, seg_size)
    try:
        message = recv_frame(sock)
    except ChannelClosed:
        return 0
    try:
        name, options = _options(message)
        backend = backends.create(name, options)
    except Exception as exc:
        send_frame(sock, error_frame(exc))
        return 1
    heap.settle()  # the loaded model is long-lived: out of the collector's walks
    send_frame(
        sock,
        {
            "ok": True,
            "pid": os.getpid(),
            "inputs": specs_to_wire(backend.inputs),
            "outputs": specs_to_wire(backend.outputs),
            "max_batch_size": batch_limit(backend),
        },
    )
    _serve(sock, segment, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
