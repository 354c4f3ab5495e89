"""The `appliance serve` process: start-up, bad config, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from serve_process import start_serve

from devtools import modelgen

GOOD = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}


def test_sigterm_drains_in_flight_requests_and_exits_zero(tmp_path: Path) -> None:
    # a long batching delay keeps requests in flight when SIGTERM arrives
    modelgen.write_model(
        tmp_path,
        "simple",
        modelgen.simple_add_sub(),
        "max_batch_size: 8\ndynamic_batching: {max_queue_delay_microseconds: 1500000}\n",
    )
    proc, port, lines = start_serve("--model-repository", str(tmp_path))
    try:
        statuses: list[int] = []

        def call() -> None:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v2/models/simple/infer",
                data=json.dumps(GOOD).encode(),
                method="POST",
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                statuses.append(resp.status)
                assert json.load(resp)["outputs"][0]["data"] == list(range(1, 17))

        callers = [threading.Thread(target=call) for _ in range(3)]
        for t in callers:
            t.start()
        time.sleep(0.5)  # let them reach the queue (they wait 1.5 s for a batch)
        proc.send_signal(signal.SIGTERM)
        for t in callers:
            t.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert statuses == [200, 200, 200]  # nothing in flight was dropped
    log = "".join(lines)
    assert "shutting down" in log and "stopped" in log


def test_demo_models_serve_with_no_arguments() -> None:
    proc, port, _ = start_serve()
    try:
        doc = json.load(
            urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v2/repository/index", data=b"", timeout=10
            )
        )
        assert {(r["name"], r["state"]) for r in doc} == {
            ("simple", "READY"),
            ("classifier", "READY"),
            ("preprocess", "READY"),
            ("postprocess", "READY"),
            ("image_classifier", "READY"),
        }
    finally:
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C is as graceful as SIGTERM
        assert proc.wait(30) == 0


def test_bad_server_config_is_one_clear_line(tmp_path: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text("http_port: eighty\n")
    result = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{config}: http_port: expected an integer >= -1, got 'eighty'" in result.stderr
    assert "Traceback" not in result.stderr


def test_event_loop_choice() -> None:
    import asyncio

    from appliance.cli import loop_factory
    from appliance.config.fields import ConfigError
    from appliance.config.server_config import load_server_config

    loop = loop_factory("asyncio")()
    try:
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()
    auto = loop_factory("auto")()  # uvloop when installed, asyncio otherwise
    auto.close()
    with pytest.raises(ConfigError, match="event_loop: expected one of auto, asyncio, uvloop"):
        load_server_config(None, {"event_loop": "trio"})


def test_example_configs_are_valid() -> None:
    from appliance.config.model_config import parse_model_config
    from appliance.config.server_config import load_server_config

    root = Path(__file__).resolve().parent.parent / "configs"
    server = load_server_config(root / "appliance.yaml", {})
    assert server.model_repository is not None and (server.model_repository / "simple").is_dir()
    import yaml

    example = yaml.safe_load((root / "models" / "mymodel" / "config.yaml").read_text())
    config = parse_model_config(example, "example", "models/mymodel/config.yaml")
    assert config.instance_count == 2 and config.dynamic_batching is not None


def test_every_option_and_argument_of_every_command_has_help() -> None:
    import argparse

    from appliance.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "appliance")
    assert missing == []


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`appliance doctor | head` closes the pipe early: the command ends with status 1
    and no traceback (before: BrokenPipeError's traceback). (argparse's --help ignores
    a closed pipe by itself, so the command is one that prints a report.)"""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the command writes anything: every write fails
    try:
        result = subprocess.run(
            [sys.executable, "-m", "appliance", "doctor"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1, result.stderr.decode()
    assert b"Traceback" not in result.stderr and b"BrokenPipe" not in result.stderr
