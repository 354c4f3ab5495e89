"""Command line: ``appliance serve``.

Runs one asyncio process until SIGTERM or Ctrl-C, then shuts down gracefully and
exits 0. Bad configuration is reported as one line naming the file and field,
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from appliance import __version__
from appliance.config import load_server_config
from appliance.errors import ApplianceError
from appliance.server import Server


def _setup_logging(level: str) -> None:
    # journald timestamps each line itself; elsewhere we add our own
    fmt = "%(levelname)s %(name)s: %(message)s"
    if "JOURNAL_STREAM" not in os.environ:
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr)


async def _serve(server: Server) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    await stop.wait()
    await server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model repository (default: the demo models)")
    serve.add_argument("--model-repository", type=Path, help="model repository directory")
    serve.add_argument("--config", type=Path, help="server config file (appliance.yaml)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--http-port", type=int, help="KServe v2 HTTP port (default 8000)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default 8002, -1 off)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_server_config(
            args.config,
            {
                "model_repository": args.model_repository,
                "host": args.host,
                "http_port": args.http_port,
                "metrics_port": args.metrics_port,
                "log_level": args.log_level,
            },
        )
    except ApplianceError as exc:
        print(f"appliance: error: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    try:
        asyncio.run(_serve(Server(config)))
    except ApplianceError as exc:
        logging.getLogger("appliance").error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
