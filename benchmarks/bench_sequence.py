"""Requests/s of many concurrent sequences through the sequence batcher, direct vs oldest.

A benchmark, not a test. The server runs in this process (``InProcessServer``, so
the figures are the scheduler's and the model's, without a wire) with a temporary
repository holding the ONNX accumulator (``devtools.modelgen.accumulator``: INT32
[batch, 1] plus its implicit state) twice: ``acc_direct`` (direct strategy) and
``acc_oldest`` (oldest strategy, ``max_candidate_sequences`` = sequences). Each of N
concurrent sequences sends ``--steps`` requests one after the other (START on the
first, END on the last), as a tracker or a streaming sensor would; every sequence's
final value is checked against the sum it sent.

Run: ``python benchmarks/bench_sequence.py [--sequences 1 8 32] [--steps 200]``.
Results are printed as markdown (requests/s, mean batch size from the statistics).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)

from appliance import InProcessServer  # noqa: E402
from devtools import modelgen  # noqa: E402

CONFIG = """\
backend: onnxruntime
max_batch_size: {max_batch}
input: [{{name: INPUT, data_type: TYPE_INT32, dims: [1]}}]
output: [{{name: OUTPUT, data_type: TYPE_INT32, dims: [1]}}]
sequence_batching:
  {strategy}
  control_input:
    - {{name: READY, control: [{{kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1]}}]}}
  state:
    - {{input_name: STATE_IN, output_name: STATE_OUT, data_type: TYPE_INT32, dims: [1]}}
"""


async def run_case(server: InProcessServer, model: str, sequences: int, steps: int) -> float:
    async def one(sid: int) -> int:
        out: dict[str, np.ndarray] = {}
        for step in range(steps):
            out = await server.infer(
                model,
                {"INPUT": np.array([[1]], np.int32)},
                sequence_id=sid,
                sequence_start=step == 0,
                sequence_end=step == steps - 1,
            )
        return int(out["OUTPUT"][0, 0])

    started = time.perf_counter()
    totals = await asyncio.gather(*(one(1000 + i) for i in range(sequences)))
    elapsed = time.perf_counter() - started
    assert totals == [steps] * sequences, totals
    return sequences * steps / elapsed


async def main(args: argparse.Namespace) -> None:
    top = max(args.sequences)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        strategies = {
            "acc_direct": "direct: {}",
            "acc_oldest": f"oldest: {{max_candidate_sequences: {top}, "
            f"max_queue_delay_microseconds: {args.delay_us}}}",
        }
        for name, strategy in strategies.items():
            text = CONFIG.format(max_batch=args.max_batch_size, strategy=strategy)
            modelgen.write_model(repo, name, modelgen.accumulator(), text)
        async with InProcessServer(repo) as server:
            print("| machine | |\n|---|---|")
            for key, value in describe("onnxruntime").items():
                print(f"| {key} | {value} |")
            print(f"\nsteps per sequence: {args.steps}, max_batch_size {args.max_batch_size}\n")
            print("| model | sequences | requests/s | mean batch size |")
            print("|---|---|---|---|")
            for model in strategies:
                for n in args.sequences:
                    before = server.statistics(model)["model_stats"][0]
                    rate = await run_case(server, model, n, args.steps)
                    after = server.statistics(model)["model_stats"][0]
                    rows = after["inference_count"] - before["inference_count"]
                    calls = after["execution_count"] - before["execution_count"]
                    print(f"| {model} | {n} | {rate:,.0f} | {rows / max(calls, 1):.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--delay-us", type=int, default=0, help="oldest: queue delay")
    asyncio.run(main(parser.parse_args()))
