"""Command line: appliance serve, and the other subcommands.

Runs one asyncio process until SIGTERM or Ctrl-C, then shuts down gracefully and
exits 0. Bad configuration is reported as one line naming the file and field,
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from appliance.cli_commands import add_doctor_parser, add_perf_parser, add_tune_parser
from appliance.cli_parser import OneLineParser, port
from appliance.config.server_config import ServerConfig, load_server_config
from appliance.errors import ApplianceError, Code
from appliance.ota import cli as ota_cli
from appliance.sdnotify import SystemdLink
from appliance.server import Server
from appliance.version import __version__


def _setup_logging(level: str) -> None:
    # journald timestamps each line itself; elsewhere we add our own
    fmt = "%(levelname)s %(name)s: %(message)s"
    if "JOURNAL_STREAM" not in os.environ:
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr)


# the subcommands other than serve, by the module that runs each
TOOLS = {
    "perf": "appliance.perf.command",
    "tune": "appliance.perf.tune",
    "doctor": "appliance.doctor",
}

# event loop implementations by name (uvicorn's convention): "auto" prefers uvloop,
# whose C transports cut the per-request cost of reading large bodies
LOOPS = {"asyncio": "asyncio:new_event_loop", "uvloop": "uvloop:new_event_loop"}


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event-loop constructor for ``name``; INVALID_ARG if uvloop is asked for but missing."""
    if name == "auto":
        try:
            return loop_factory("uvloop")
        except ApplianceError:
            return loop_factory("asyncio")
    module_name, _, attr = LOOPS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ApplianceError(
            Code.INVALID_ARG, f"event_loop '{name}' needs the '{name}' package: pip install {name}"
        ) from None
    factory: Callable[[], asyncio.AbstractEventLoop] = getattr(module, attr)
    return factory


def run(main: Coroutine[Any, Any, None], factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """asyncio.run with a chosen loop (asyncio.Runner's loop_factory needs Python 3.11)."""
    loop = factory()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _serve(server: Server, reread: Callable[[], ServerConfig] | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if reread is not None:  # SIGHUP: the config file read again, its streams applied
        loop.add_signal_handler(signal.SIGHUP, server.reload_soon, reread)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    # under systemd (Type=notify): READY=1 once the models are, watchdog pings, STOPPING=1
    systemd = SystemdLink(server.lifecycle.all_ready, lambda: _status(server))
    systemd.start()
    await stop.wait()
    systemd.stopping_now()
    await server.stop()
    await systemd.close()


def _rereader(args: argparse.Namespace) -> Callable[[], ServerConfig] | None:
    """What a SIGHUP reads: the config file again (its streams are what a reload
    applies), with the flags a stream's validation depends on."""
    if args.config is None:
        return None
    flags = {"model_repository": args.model_repository, "mqtt_broker": args.mqtt_broker}
    return lambda: load_server_config(args.config, flags)


def _status(server: Server) -> str:
    """The STATUS= line `systemctl status` shows."""
    versions = len(server.lifecycle.loaded())
    if server.lifecycle.all_ready():
        return f"serving {versions} model version(s)"
    return f"not ready: {versions} model version(s) serving, see the log for what failed"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="appliance",
        description="Edge inference server speaking KServe v2 / Triton (HTTP, gRPC, MQTT).",
    )
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model repository (default: the demo models)")
    serve.add_argument("--model-repository", type=Path, help="model repository directory")
    serve.add_argument("--config", type=Path, help="server config file (appliance.yaml)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--http-port", type=port, help="KServe v2 HTTP port (default 8000, -1 off)")
    serve.add_argument("--grpc-port", type=port, help="KServe v2 gRPC port (default 8001, -1 off)")
    serve.add_argument("--metrics-port", type=port, help="Prometheus port (default 8002, -1 off)")
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info); logs go to stderr, or the journal under systemd",
    )
    serve.add_argument(
        "--model-control-mode",
        choices=["none", "explicit", "poll"],
        help="none: load all at start, no changes; explicit (default): load --load-model "
        "at start, the rest on request; poll: load all and follow the repository",
    )
    serve.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        help="explicit mode: a model to load at start (repeatable; '*' = all, the default)",
    )
    serve.add_argument("--repository-poll-secs", type=float, help="poll mode: seconds (15)")
    serve.add_argument(
        "--memory-limit", help="memory all loaded models may use, e.g. 1.5GiB or 60%% of RAM"
    )
    serve.add_argument(
        "--rate-limit",
        choices=["off", "execution_count"],
        help="Triton's rate limiter: instances run holding their rate_limiter resources",
    )
    serve.add_argument(
        "--rate-limit-resource",
        action="append",
        metavar="NAME:COUNT[:DEVICE]",
        help="how many of a rate-limiter resource exist (repeatable; no DEVICE: each device)",
    )
    serve.add_argument(
        "--mqtt-broker", metavar="HOST:PORT", help="serve requests over MQTT from this broker"
    )
    ota_cli.register(sub)  # fleet, bundle, ota: see appliance/ota/cli.py
    add_perf_parser(sub)
    add_tune_parser(sub)
    add_doctor_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``appliance`` command; its exit status. Output into a pipe that closes early
    (``appliance bundle inspect B | head``) ends the command quietly, status 1."""
    try:
        return _run(argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush
        # cannot fail a second time (the recipe of Python's signal documentation)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("fleet", "bundle", "ota"):
        return ota_cli.run(args)
    if args.command in ("perf", "tune", "doctor"):
        # their code (load generator, clients, device checks) loads only when asked for
        runner = importlib.import_module(TOOLS[args.command])
        status: int = runner.main(args)
        return status
    try:
        config = load_server_config(
            args.config,
            {
                "model_repository": args.model_repository,
                "host": args.host,
                "http_port": args.http_port,
                "grpc_port": args.grpc_port,
                "metrics_port": args.metrics_port,
                "log_level": args.log_level,
                "model_control_mode": args.model_control_mode,
                "load_model": args.load_model,
                "repository_poll_secs": args.repository_poll_secs,
                "memory_limit": args.memory_limit,
                "rate_limit": args.rate_limit,
                "rate_limit_resources": args.rate_limit_resource,
                "mqtt_broker": args.mqtt_broker,
            },
        )
    except ApplianceError as exc:
        print(f"appliance: error: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    try:
        run(_serve(Server(config), _rereader(args)), loop_factory(config.event_loop))
    except ApplianceError as exc:
        logging.getLogger("appliance").error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
