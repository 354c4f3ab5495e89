"""The response cache's hit latency against the model's: one request repeated.

A benchmark, not a test. The server runs as a subprocess (``python -m appliance
serve``) on a free loopback port with ``response_cache_size: 64MiB`` and two copies of
one MLP (``modelgen.mlp(in_features, hidden)``, FP32), ``cached`` with
``response_cache {enable: true}`` and ``plain`` without. One client (tritonclient HTTP,
binary tensors) sends the same request ``--requests`` times to each, after a warm-up;
the table gives the client's round-trip percentiles and, from the statistics
extension, the server's mean time per request (``success``), the model's mean compute
time (``compute_infer``, plain) and the mean cache look-up of a hit (``cache_hit``).

Run: ``python benchmarks/bench_response_cache.py [--requests 2000] [--hidden 2048]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from probes import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from devtools import modelgen  # noqa: E402

CONFIG = """\
backend: onnxruntime
max_batch_size: 8
input: [{{name: input, data_type: TYPE_FP32, dims: [{n}]}}]
output: [{{name: output, data_type: TYPE_FP32, dims: [16]}}]
response_cache: {{enable: {cached}}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        model = modelgen.mlp(args.features, args.hidden)
        for name, cached in (("cached", "true"), ("plain", "false")):
            modelgen.write_model(repo, name, model, CONFIG.format(n=args.features, cached=cached))
        port = free_port()
        cmd = [
            sys.executable, "-m", "appliance", "serve", "--model-repository", str(repo),
            "--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1",
        ]  # fmt: skip
        config = Path(tmp) / "appliance.yaml"
        config.write_text("response_cache_size: 64MiB\n")
        cmd += ["--config", str(config)]
        server = subprocess.Popen(cmd, cwd=REPO_ROOT)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            for _ in range(600):
                try:
                    if client.is_model_ready("cached") and client.is_model_ready("plain"):
                        break
                except Exception:  # not listening yet
                    pass
                time.sleep(0.1)
            x = np.random.default_rng(0).standard_normal((1, args.features)).astype(np.float32)
            tensor = httpclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            out = [httpclient.InferRequestedOutput("output", binary_data=True)]
            rows = []
            for name in ("plain", "cached"):
                for _ in range(50):  # warm-up (and the cached model's one miss)
                    client.infer(name, [tensor], outputs=out)
                before = client.get_inference_statistics(name)["model_stats"][0]
                times = []
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    client.infer(name, [tensor], outputs=out)
                    times.append(time.perf_counter() - t0)
                after = client.get_inference_statistics(name)["model_stats"][0]
                rows.append((name, np.array(times) * 1e3, before, after))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; MLP {args.features}-{args.hidden}-"
          f"{args.hidden}-16 FP32, batch 1, {args.requests} requests each, one client")  # fmt: skip
    print()
    print(
        "| model | p50 ms | p90 ms | p99 ms | server ms/request | compute_infer ms "
        "| cache hit ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ms, before, after in rows:

        def mean(kind: str, b=before, a=after) -> str:
            s0, s1 = b["inference_stats"][kind], a["inference_stats"][kind]
            count = int(s1["count"]) - int(s0["count"])
            return f"{(int(s1['ns']) - int(s0['ns'])) / count / 1e6:.3f}" if count else "-"

        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        print(
            f"| {name} | {p50:.3f} | {p90:.3f} | {p99:.3f} | {mean('success')} "
            f"| {mean('compute_infer')} | {mean('cache_hit')} |"
        )


if __name__ == "__main__":
    main()
