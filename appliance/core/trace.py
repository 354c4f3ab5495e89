"""Triton's trace extension: per-request timestamps written to a trace file.

Settings (server-wide, and per model on top): ``trace_level`` (``OFF`` or
``TIMESTAMPS``; ``TENSORS`` is refused), ``trace_rate`` (trace one request in N),
``trace_count`` (stop after N traces; -1: no limit), ``log_frequency`` (write a
file every N traces, named ``<trace_file>.<k>``; 0: one file, written when
tracing is turned off or the server stops), ``trace_file`` and ``trace_mode``
(``triton``). Values travel as strings, as in Triton. A model setting set to
``null`` (or an empty list, gRPC's way) falls back to the server's; a server setting
cleared so goes back to its default, as in Triton. Without a ``trace_file`` every
setting is taken except a level other than OFF, which Triton refuses too ("trace
file name is not given").

The file is Triton's JSON trace format: a JSON array with, per trace, an object
``{id, model_name, model_version, request_id}`` and an object ``{id, timestamps:
[{name, ns}]}``, where the names are Triton's (REQUEST_START, QUEUE_START,
COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END, REQUEST_END)
and ``ns`` is the monotonic clock (CLOCK_MONOTONIC, as Triton's steady clock).

The trace file's location comes from the server config only (``trace_file``): a
path a network client could set would let it write files anywhere the server can.
All methods run on the event loop; files are written on a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from pathlib import Path
from typing import Any

from appliance.errors import invalid

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "triton",
}
_INTS = {"trace_rate": 1, "trace_count": -1, "log_frequency": 0}  # setting -> minimum


def _normalise(key: str, value: Any) -> Any:
    """One setting from a request -> its stored form; INVALID_ARG when wrong."""
    if key == "trace_level":
        levels = value if isinstance(value, list) else [value]
        if not levels or not all(isinstance(x, str) for x in levels):
            raise invalid("trace_level must be a list of OFF, TIMESTAMPS")
        levels = [x.upper() for x in levels]
        unknown = [x for x in levels if x not in ("OFF", "TIMESTAMPS", "TENSORS")]
        if unknown:
            raise invalid(f"unknown trace_level {unknown}; expected OFF or TIMESTAMPS")
        if "TENSORS" in levels:
            raise invalid("trace_level TENSORS is not supported; use TIMESTAMPS")
        return ["OFF"] if "OFF" in levels or not levels else levels
    if key in _INTS:
        text = str(value[0] if isinstance(value, list) and len(value) == 1 else value)
        try:
            number = int(text)
        except ValueError:
            raise invalid(f"{key} must be an integer, got {value!r}") from None
        if number < _INTS[key]:
            raise invalid(f"{key} must be >= {_INTS[key]}, got {number}")
        return str(number)
    if key == "trace_mode":
        if str(value).lower() != "triton":
            raise invalid(f"trace_mode {value!r} is not supported; expected 'triton'")
        return "triton"
    if key == "trace_file":
        raise invalid(
            "trace_file cannot be changed through the network protocol; "
            "set trace_file in the server config"
        )
    raise invalid(f"unknown trace setting '{key}'; expected one of {sorted(DEFAULTS)}")


class Trace:
    """One traced request; :meth:`Tracer.finish` records it."""

    __slots__ = ("id", "model", "start_ns")

    def __init__(self, trace_id: int, model: str, start_ns: int) -> None:
        self.id = trace_id
        self.model = model
        self.start_ns = start_ns


class Tracer:
    """The trace settings and the traces collected for the file."""

    def __init__(self, trace_file: Path | None, start: dict[str, Any] | None = None) -> None:
        self._file = trace_file
        self._global: dict[str, Any] = {**DEFAULTS, "trace_file": str(trace_file or "")}
        self._models: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, int] = {}  # model -> requests since its last trace
        self._ids = itertools.count(1)
        self._pending: list[dict[str, Any]] = []
        self._file_index = 0
        self._writes: set[asyncio.Task[None]] = set()
        self.active = False  # any level not OFF: the cheap check on the hot path
        if start:  # the server config's trace_settings (Triton's --trace-config)
            self.update(start)

    # ---- settings ---------------------------------------------------------------------

    def settings(self, model: str = "") -> dict[str, Any]:
        return {**self._global, **self._models.get(model, {})} if model else dict(self._global)

    def update(self, changes: dict[str, Any], model: str = "") -> dict[str, Any]:
        """Apply ``changes`` (``None`` clears a model's own value) and return the
        settings now in force for ``model`` (or the server)."""
        parsed: dict[str, Any] = {}
        for key, value in changes.items():
            if value is None or value == []:  # cleared (gRPC sends an empty list)
                if key not in DEFAULTS:
                    _normalise(key, "")  # the error for an unknown setting
                parsed[key] = None
            else:
                parsed[key] = _normalise(key, value)
        target = self._models.setdefault(model, {}) if model else self._global
        for key, value in parsed.items():
            if value is not None:
                target[key] = value
            elif model:  # a model's own value cleared: the server's applies again
                target.pop(key, None)
            elif key != "trace_file":  # the server's cleared: back to Triton's default
                target[key] = DEFAULTS[key]
        was_active = self.active
        self.active = any(self.settings(m)["trace_level"] != ["OFF"] for m in ("", *self._models))
        if self.active and self._file is None:
            self.active = False
            self._global["trace_level"] = ["OFF"]
            for own in self._models.values():
                own.pop("trace_level", None)
            raise invalid(
                "Attempting to set invalid trace setting: trace file name is not given; "
                "set trace_file in the server config"
            )
        if was_active and not self.active:
            self._flush()
        return self.settings(model)

    # ---- tracing ----------------------------------------------------------------------

    def begin(self, model: str, start_ns: int) -> Trace | None:
        """Whether to trace this request (rate and count), as a :class:`Trace`."""
        settings = self.settings(model)
        if settings["trace_level"] == ["OFF"]:
            return None
        count = int(settings["trace_count"])
        if count == 0:
            return None
        seen = self._seen.get(model, 0) + 1
        if seen < int(settings["trace_rate"]):
            self._seen[model] = seen
            return None
        self._seen[model] = 0
        if count > 0:
            own = self._models.get(model)
            (own if own is not None and "trace_count" in own else self._global)["trace_count"] = (
                str(count - 1)
            )
        return Trace(next(self._ids), model, start_ns)

    def finish(
        self,
        trace: Trace,
        version: str,
        request_id: str,
        timing: tuple[int, int, int, int, int, int] | None,
        end_ns: int,
    ) -> None:
        """Record a traced request. ``timing``: the model's (start, queue, input,
        infer, output, end) in monotonic ns and durations, when it ran."""
        stamps = [("REQUEST_START", trace.start_ns)]
        if timing is not None:
            start, queue, inputs, infer, output, _end = timing
            compute = start + queue
            stamps += [
                ("QUEUE_START", start),
                ("COMPUTE_START", compute),
                ("COMPUTE_INPUT_END", compute + inputs),
                ("COMPUTE_OUTPUT_START", compute + inputs + infer),
                ("COMPUTE_END", compute + inputs + infer + output),
            ]
        stamps.append(("REQUEST_END", end_ns))
        head: dict[str, Any] = {"id": trace.id, "model_name": trace.model}
        if version.isdigit():
            head["model_version"] = int(version)
        if request_id:
            head["request_id"] = request_id
        self._pending += [
            head,
            {"id": trace.id, "timestamps": [{"name": n, "ns": ns} for n, ns in stamps]},
        ]
        frequency = int(self.settings(trace.model)["log_frequency"])
        if frequency and len(self._pending) >= 2 * frequency:
            self._flush()

    def _flush(self) -> None:
        if not self._pending or self._file is None:
            return
        frequency = int(self._global["log_frequency"])
        if frequency:
            path = Path(f"{self._file}.{self._file_index}")
            self._file_index += 1
        else:
            path = self._file
        records, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(_write, path, records))
        self._writes.add(task)  # keep a hard reference until it is written
        task.add_done_callback(self._writes.discard)

    async def stop(self) -> None:
        """Write what is collected and wait for every write (server shutdown)."""
        self._flush()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    try:
        path.write_text(json.dumps(records, indent=None))
    except OSError as exc:
        log.error("cannot write trace file %s: %s", path, exc)
