"""What model instances cost in memory, with and without a shared engine session.

    python3 benchmarks/bench_memory.py [--out FILE]

Loads the demo classifier and a 24 MiB MLP with four instances each, once with one
ONNX Runtime session per instance and once with one session shared by the four, with
the implicit warm-up (batch 1) and with a batch-8 warm-up, and prints the measured
costs as the server's memory budget sees them (first instance, each further one,
the copy), then swaps the MLP eight times and reports RSS before and after. Takes
about ten seconds. Needs the test extra (onnx) for the models.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout: devtools/ is not installed

from machine import describe  # noqa: E402  (benchmarks/machine.py, next to this script)

from appliance import InProcessServer  # noqa: E402
from appliance.core.memory import MiB, rss_bytes  # noqa: E402
from devtools import modelgen  # noqa: E402

WARM_B8 = (
    "model_warmup: [{name: b8, batch_size: 8, inputs: {input: "
    "{data_type: TYPE_FP32, dims: [3, 224, 224], zero_data: true}}}]\n"
)


def _repository(repo: Path) -> list[str]:
    # loaded first (names sort first): ONNX Runtime's one-time start-up memory goes here
    modelgen.write_model(repo, "a_first", modelgen.simple_add_sub())
    classifier = modelgen.CLASSIFIER_CONFIG.replace("count: 1", "count: 4")
    mlp = "instance_group: [{count: 4}]\n"
    rows = []
    for share in ("true", "false"):
        param = f"parameters: {{share_session: '{share}'}}\n"
        for name, build, config in [
            (f"classifier_b1_share_{share}", modelgen.classifier, classifier + param),
            (f"classifier_b8_share_{share}", modelgen.classifier, classifier + WARM_B8 + param),
            (f"mlp_share_{share}", lambda: modelgen.mlp(1024, 2048, 16), mlp + param),
        ]:
            modelgen.write_model(repo, name, build(), config)
            rows.append(name)
    return rows


async def _measure(out: list[str]) -> None:
    repo = Path(tempfile.mkdtemp())
    names = _repository(repo)
    async with InProcessServer(repo) as server:
        costs = server.server.lifecycle.budget
        out += [
            "| model | instances | first instance | each further | copy |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in names:
            first, extra, count = costs.estimate(name, 1) or (None, None, 0)
            assert first is not None and extra is not None
            copy = server.statistics(name)["model_stats"][0]["memory_usage"][0]["byte_size"]
            out.append(
                f"| {name} | {count} | {first.total / MiB:.1f} MiB | "
                f"{extra.total / MiB:.1f} MiB | {copy / MiB:.1f} MiB |"
            )
        before = rss_bytes()
        model_file = repo / "mlp_share_false" / "1" / "model.onnx"
        for i in range(8):
            # a load keeps a copy whose config and files are unchanged: touch the file
            # so each load builds a new copy (a swap)
            os.utime(model_file, ns=(i + 1, i + 1))
            await server.server.dataplane.load_model("mlp_share_false")
        while server.server.lifecycle.draining():
            await asyncio.sleep(0.05)
        stats = server.statistics("mlp_share_false")["model_stats"][0]
        out += [
            "",
            f"Eight hot swaps of `mlp_share_false` (4 instances, "
            f"{stats['memory_usage'][0]['byte_size'] / MiB:.1f} MiB a copy after them): "
            f"RSS {before / MiB:.1f} MiB before, {rss_bytes() / MiB:.1f} MiB after.",
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    machine = "; ".join(f"{k} {v}" for k, v in describe("onnxruntime").items())
    out = [
        f"# Memory per instance, {datetime.date.today()}",
        "",
        "```\npython3 benchmarks/bench_memory.py\n```",
        "",
        f"Machine: {machine}.",
        "",
    ]
    asyncio.run(_measure(out))
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
