"""The LLM engine's own process: OpenVINO GenAI's continuous-batching pipeline.

Why a process: the pipeline's ``step()`` holds Python's GIL for its whole run (tens
of milliseconds a step on a CPU), which would stall the server's event loop at every
token. Here it stalls nobody. The server side is :mod:`appliance.backends.llm_backend`.

Wire: frames of a 4-byte little-endian length and an orjson object, requests on
stdin, answers on a duplicate of stdout (stdout itself goes to stderr, so whatever
the engine prints never corrupts a frame). In: the settings first, then
``{"op": "add", "id", "prompt" | "messages", "config"}`` and ``{"op": "cancel", "id"}``;
stdin's end is the end. Out: ``{"op": "ready", "kv_bytes", "rss"}`` or
``{"op": "failed", "error"}`` once, then after every step one ``{"op": "step",
"items": [[id, text, new_tokens, input_tokens, finish, error], ...]}``, where
``text`` is the request's new text and ``finish`` is ``""`` until its last item
(``stop``, ``length`` or ``cancelled``).

Text is decoded from all of a request's tokens at each step and only what is new is
sent; text that may be the start of a stop string, or an incomplete UTF-8 character,
waits for the next step.
"""

from __future__ import annotations

import os
import queue
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

HEADER = struct.Struct("<I")
REFUSED = "refused: "  # an error item's prefix when the request itself was refused
MAX_FRAME = 64 * 2**20


def write_frame(out: IO[bytes], obj: Any) -> None:
    body = orjson.dumps(obj)
    out.write(HEADER.pack(len(body)) + body)
    out.flush()


def read_frame(inp: IO[bytes]) -> Any | None:
    """The next frame, or None at the end of the stream."""
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    body = inp.read(size)
    if len(body) < size:
        return None
    return orjson.loads(body)


@dataclass(slots=True)
class _Job:
    handle: Any
    input_tokens: int
    stops: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already sent
    cancelled: bool = False
    length: bool = False  # the engine stopped it at max_tokens


class Engine:
    """The pipeline and the requests it is generating."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import openvino_genai as genai  # the engine process only

        self._genai = genai
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = settings["kv_cache_gib"]
        scheduler.num_kv_blocks = settings["kv_cache_blocks"]
        scheduler.max_num_seqs = settings["max_num_seqs"]
        scheduler.max_num_batched_tokens = settings["max_num_batched_tokens"]
        scheduler.enable_prefix_caching = settings["enable_prefix_caching"]
        scheduler.dynamic_split_fuse = True
        properties: dict[str, Any] = {}
        if settings["threads"]:
            properties["INFERENCE_NUM_THREADS"] = settings["threads"]
        self.pipe = genai.ContinuousBatchingPipeline(
            settings["model_path"], scheduler, settings["device"], properties
        )
        self.tokenizer = self.pipe.get_tokenizer()
        self.jobs: dict[int, _Job] = {}
        self._running = genai.GenerationStatus.RUNNING
        self._ignored = genai.GenerationStatus.IGNORED
        self._length = genai.GenerationFinishReason.LENGTH

    def warm_up(self) -> None:
        """One token through the pipeline: compiles it and allocates a KV cache sized
        in blocks, so the memory it holds is measured before the model serves."""
        self.add({"id": -1, "prompt": "Hello", "config": {"max_tokens": 1}})
        while self.jobs:
            self.step()

    def kv_bytes(self) -> int:
        return int(self.pipe.get_metrics().kv_cache_size_in_bytes)

    def add(self, frame: dict[str, Any]) -> list[Any] | None:
        """Start one request; an item that ends it at once when it is refused."""
        job_id = int(frame["id"])
        try:
            config = self._config(frame["config"])
            if frame.get("messages") is not None:
                prompt = self.tokenizer.apply_chat_template(
                    frame["messages"], add_generation_prompt=True
                )
                special = False  # the template wrote the special tokens itself
            else:
                prompt, special = frame["prompt"], True
            ids = self.tokenizer.encode([prompt], add_special_tokens=special).input_ids
            count = int(ids.shape[1])
            handle = self.pipe.add_request(job_id, ids, config)
        except Exception as exc:  # a template or setting the engine refuses
            return [job_id, "", 0, 0, "", f"{REFUSED}{type(exc).__name__}: {exc}"]
        stops = tuple(s for s in frame["config"].get("stop", ()) if s)
        self.jobs[job_id] = _Job(handle, count, stops)
        return None

    def _config(self, wanted: dict[str, Any]) -> Any:
        config = self._genai.GenerationConfig()
        config.max_new_tokens = int(wanted["max_tokens"])
        temperature = float(wanted.get("temperature", 0.0))
        if temperature > 0:
            config.do_sample = True
            config.temperature = temperature
            config.top_p = float(wanted.get("top_p", 1.0))
            if wanted.get("top_k"):
                config.top_k = int(wanted["top_k"])
        else:
            config.do_sample = False
        if wanted.get("seed") is not None:
            config.rng_seed = int(wanted["seed"])
        if wanted.get("ignore_eos"):
            config.ignore_eos = True
        return config

    def cancel(self, job_id: int) -> None:
        job = self.jobs.get(job_id)
        if job is not None and not job.cancelled:
            job.cancelled = True
            job.handle.cancel()

    def step(self) -> list[Any]:
        """One step of every request; the items it produced."""
        self.pipe.step()
        items = []
        for job_id, job in list(self.jobs.items()):
            before = len(job.ids)
            while job.handle.can_read():
                for output in job.handle.read().values():
                    job.ids.extend(output.generated_ids)
                    job.length = output.finish_reason == self._length
            status = job.handle.get_status()
            if status == self._ignored:  # the scheduler cannot fit it in the KV cache
                del self.jobs[job_id]
                why = (
                    f"{REFUSED}the request ({job.input_tokens} prompt tokens, {len(job.ids)} "
                    "generated) does not fit the KV cache (kv_cache_size, kv_cache_blocks)"
                )
                items.append([job_id, "", 0, job.input_tokens, "", why])
                continue
            done = job.cancelled or status != self._running
            text = self.tokenizer.decode(job.ids) if len(job.ids) > before or done else ""
            finish = ""
            if text:
                cut = _stop_at(text, job.stops, job.sent)
                if cut is not None:
                    text, done = text[:cut], True
                    job.handle.stop()
                    finish = "stop"
            if done:
                del self.jobs[job_id]
                if not finish:
                    finish = "cancelled" if job.cancelled else ("length" if job.length else "stop")
                new = text[job.sent :] if text else ""
            else:
                new = _ready_text(text, job.sent, job.stops) if text else ""
            job.sent += len(new)
            new_tokens = len(job.ids) - before
            if new or new_tokens or done:
                items.append([job_id, new, new_tokens, job.input_tokens, finish, ""])
        return items


def _stop_at(text: str, stops: tuple[str, ...], sent: int) -> int | None:
    """Where the first stop string starts in ``text`` (searched from just before what
    was sent), or None."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, sent - longest)
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _ready_text(text: str, sent: int, stops: tuple[str, ...]) -> str:
    """The new text that can go now: not a trailing partial character, nor what may
    be the start of a stop string."""
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end - sent), 0, -1):
            if text.endswith(stop[:k], 0, end):
                end -= k
                break
    return text[sent:end] if end > sent else ""


def _read_requests(inp: IO[bytes], inbox: queue.SimpleQueue[Any]) -> None:
    try:
        while (frame := read_frame(inp)) is not None:
            inbox.put(frame)
    finally:
        inbox.put(None)


def main() -> int:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the engine's own prints go to stderr, never into a frame
    inp = sys.stdin.buffer
    settings = read_frame(inp)
    if settings is None:
        return 0
    try:
        engine = Engine(settings)
        engine.warm_up()
    except Exception as exc:
        write_frame(out, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    write_frame(out, {"op": "ready", "kv_bytes": engine.kv_bytes()})
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=_read_requests, args=(inp, inbox), daemon=True).start()
    while True:
        frames = [inbox.get()] if not engine.jobs else []
        while True:  # whatever else arrived meanwhile
            try:
                frames.append(inbox.get_nowait())
            except queue.Empty:
                break
        items = []
        for frame in frames:
            if frame is None:
                return 0
            if frame["op"] == "add":
                refused = engine.add(frame)
                if refused is not None:
                    items.append(refused)
            elif frame["op"] == "cancel":
                engine.cancel(int(frame["id"]))
        if engine.jobs:
            try:
                items += engine.step()
            except Exception as exc:  # the step failed: every request it held fails
                error = f"{type(exc).__name__}: {exc}"
                items += [[i, "", 0, j.input_tokens, "", error] for i, j in engine.jobs.items()]
                engine.jobs.clear()
        if items:
            write_frame(out, {"op": "step", "items": items})


if __name__ == "__main__":
    sys.exit(main())
