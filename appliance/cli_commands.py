"""The options of ``appliance perf``, ``appliance tune`` and ``appliance doctor``.

Kept apart from the modules that run them, which are imported only when their
subcommand runs: the command line offers every subcommand while ``appliance serve``
imports none of their code (the load generator, its gRPC and MQTT clients,
prometheus_client's parser, the device checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# how ``appliance perf`` calls (appliance.perf.transports implements each)
TRANSPORTS = ("http", "grpc", "shm", "mqtt", "inprocess")
# ``appliance tune --preferred``: the preferred batch sizes a trial may declare
PREFERRED = ("none", "max", "pow2")


def add_perf_parser(sub: Any) -> None:
    """Register ``perf`` on the ``appliance`` command's subparsers."""
    p = sub.add_parser("perf", help="measure throughput and latency of a KServe v2 server")
    p.add_argument("-m", "--model", help="model name (default with --ceiling: trivial)")
    p.add_argument("-x", "--model-version", default="", help="version (default: the server's)")
    p.add_argument("-u", "--url", default="127.0.0.1:8000", help="HTTP host:port")
    p.add_argument("-i", "--transport", choices=TRANSPORTS, default="http", help="how to call")
    p.add_argument("--grpc-url", default="", help="gRPC host:port (default: -u's host, 8001)")
    p.add_argument("--metrics-url", default="", help="metrics host:port (default: -u's host, 8002)")
    p.add_argument("--mqtt-broker", default="127.0.0.1:1883", help="MQTT broker host:port")
    p.add_argument("--mqtt-prefix", default="appliance", help="the appliance's topic prefix")
    p.add_argument("--mqtt-device", default="", help="the appliance's MQTT device id")
    p.add_argument("--model-repository", type=Path, help="-i inprocess: repository to load")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1", help="closed loop: N, a,b, a:b:step, a:b:2x")
    load.add_argument("--request-rate", help="open loop (Poisson), requests/s: same syntax")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each window")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument(
        "--measurement-request-count",
        type=int,
        default=0,
        metavar="N",
        help="a window also lasts until N requests sent in it completed (0: time only)",
    )
    p.add_argument(
        "--input-data", choices=("random", "zeros", "files"), default="random", help="tensors"
    )
    p.add_argument("--input-files", type=Path, help="file or folder for --input-data files")
    p.add_argument("--json-data", action="store_true", help="-i http: send JSON, not binary")
    p.add_argument("--shape", action="append", default=[], help="NAME:d1,d2 (no batch dim)")
    p.add_argument("--token", default="", help="bearer token for the server")
    p.add_argument("--max-outstanding", type=int, default=256, help="open loop: cap")
    p.add_argument("--csv", type=Path, help="write the points as CSV")
    p.add_argument("--json", type=Path, help="write settings, machine and points as JSON")
    p.add_argument("--plot", type=Path, help="latency-throughput PNG (needs matplotlib)")
    p.add_argument("--processes", type=int, default=1, help="load-generating processes")
    p.add_argument("--quiet", action="store_true", help="no live table")
    p.add_argument("--ceiling", action="store_true", help="measure the load generator itself")


def add_tune_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="search a faster config for a model on the live server")
    p.add_argument("model", help="the loaded model to tune")
    p.add_argument("-u", "--url", default="127.0.0.1:8000", help="the server's HTTP host:port")
    p.add_argument("--token", default="", help="admin bearer token (loads configs)")
    p.add_argument("--backends", default="", help="e.g. onnxruntime,openvino (default: its own)")
    p.add_argument("--max-batch-sizes", default="", help="e.g. 1,8,32 (default: its own)")
    p.add_argument("--queue-delays-us", default="", help="e.g. 0,500,2000 (default: its own)")
    p.add_argument("--preferred", default="max", help=f"preferred sizes: {', '.join(PREFERRED)}")
    p.add_argument("--max-instances", type=int, default=2, help="most instances to try")
    p.add_argument("--memory-budget", help="most memory a config may use, e.g. 256MiB")
    p.add_argument("--p99-ms", type=float, help="objective: p99 latency at most this")
    p.add_argument("--min-throughput", type=float, help="objective: infer/s at least this")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop load per trial")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request")
    p.add_argument("-i", "--transport", choices=("http", "grpc"), default="http", help="wire")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each trial")
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per trial")
    p.add_argument(
        "--measurement-request-count",
        type=int,
        default=0,
        metavar="N",
        help="a trial's window also lasts until N requests sent in it completed",
    )
    p.add_argument("--output", type=Path, help="file for the winning config (.yaml or .pbtxt)")
    p.add_argument("--json", type=Path, help="every trial as JSON")
    p.add_argument("--apply", action="store_true", help="load the winner on the server")


def add_doctor_parser(sub: Any) -> None:
    """Register ``appliance doctor`` on the CLI's subparsers."""
    doctor = sub.add_parser("doctor", help="check this device: platform, engines, config, models")
    doctor.add_argument("--config", type=Path, help="server config file (appliance.yaml)")
    doctor.add_argument(
        "--model-repository",
        type=Path,
        help="model repository to check (as serve takes it; default: the config's, else the demo)",
    )
    doctor.add_argument(
        "--ota-url", help="OTA source to check for reachability (default: the config's ota.source)"
    )
    doctor.add_argument("--timeout", type=float, default=2.0, help="network checks (seconds)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
