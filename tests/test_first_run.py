"""A first run as a new user makes it: budget and size mistakes, what the start-up log
says against what readiness says, and command-line mistakes as one line each."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from appliance.config.fields import ConfigError
from appliance.config.server_config import load_server_config
from appliance.server import Server
from devtools import modelgen

OFF = {"http_port": 0, "grpc_port": -1, "metrics_port": -1, "drain_timeout_s": 5}


def _start_and_stop(repo: Path, **options: object) -> BaseException | None:
    """Start a real server on a free port; stop it; return what start raised."""

    async def go() -> BaseException | None:
        config = load_server_config(None, {**OFF, **options, "model_repository": repo})
        server = Server(config)
        try:
            await server.start()
        except ConfigError as exc:
            return exc
        finally:
            await server.stop()
        return None

    return asyncio.run(go())


def test_a_budget_that_admits_no_model_is_an_error_at_start(tmp_path: Path) -> None:
    modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    error = _start_and_stop(tmp_path, memory_limit="1KiB")
    assert isinstance(error, ConfigError)
    message = str(error)
    assert message.startswith("<server>: memory_limit: the memory budget of 0.0 MiB admits none")
    assert "model 'simple'" in message  # and why: what it needed


def test_the_log_names_what_failed_and_does_not_say_ready(
    run_appliance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    modelgen.write_model(tmp_path, "good", modelgen.simple_add_sub())
    modelgen.write_model(tmp_path, "bad", modelgen.simple_add_sub(), "max_batch_size: lots\n")
    with caplog.at_level(logging.INFO, logger="appliance.server"):
        srv = run_appliance(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.server"]
    summary = next(line for line in lines if "ready" in line.lower() and "model" in line)
    assert summary.startswith("NOT ready after"), summary
    assert "1 model(s) failed to load" in summary and "'bad':" in summary
    assert "max_batch_size" in summary  # the reason, not just the name
    with pytest.raises(urllib.error.HTTPError) as e:  # and readiness agrees
        urllib.request.urlopen(f"http://{srv.url}/v2/health/ready", timeout=10)
    assert e.value.code == 400


def test_an_empty_repository_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="appliance.server"):
        assert _start_and_stop(tmp_path) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("has no models" in w for w in warnings), warnings


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--http-port", "70000"], "--http-port: expected a port 0..65535"),
        (["serve", "--port", "1"], "(did you mean --http-port?) (see appliance serve --help)"),
        (["serve", "--memory-limit", "60"], "memory_limit: expected a size such as"),
        (["serve", "--config", "configs/models/mymodel/config.yaml"], "this is a model config"),
        (  # flags given beside it do not hide what the file is
            ["serve", "--config", "configs/models/mymodel/config.yaml", "--log-level", "info"],
            "this is a model config",
        ),
        (["serv"], "invalid choice: 'serv'"),
        (["doctor", "--jsn"], "(did you mean --json?) (see appliance doctor --help)"),
    ],
)
def test_every_cli_mistake_is_one_line(args: list[str], expected: str) -> None:
    root = Path(__file__).resolve().parent.parent
    if "--config" in args:
        args = [str(root / a) if a.startswith("configs/") else a for a in args]
    done = _cli(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_help_is_plain_text_and_documents_every_option() -> None:
    top, serve = _cli("--help"), _cli("serve", "--help")
    assert top.returncode == serve.returncode == 0
    assert "``" not in top.stdout + serve.stdout  # no reStructuredText markup
    assert "--log-level" in serve.stdout and "log verbosity" in serve.stdout


def test_a_budget_above_the_cgroup_limit_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from appliance.startup_report import cgroup_memory_max, check_cgroup

    with caplog.at_level(logging.WARNING, logger="appliance.server"):
        check_cgroup(None, 512 * 2**20)  # unlimited budget in a 512 MiB cgroup
        check_cgroup(300 * 2**20, 512 * 2**20)  # fits with the server's baseline
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "at most 384.0 MiB" in warnings[0]
    (tmp_path / "cgroup").write_text("0::/no/such/group\n")
    assert cgroup_memory_max(str(tmp_path / "cgroup")) is None


def test_a_model_folder_given_as_the_repository_gets_a_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = modelgen.write_model(tmp_path, "simple", modelgen.simple_add_sub())
    with caplog.at_level(logging.INFO, logger="appliance.server"):
        assert _start_and_stop(folder) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    hint = f"{folder} looks like a model folder (it holds the version folder 1/)"
    assert any(hint in w and f"such as {tmp_path}" in w for w in warnings), warnings
    (folder / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="appliance.server"):
        assert _start_and_stop(folder) is None
    assert any("(it holds config.pbtxt)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="appliance.server"):
        assert _start_and_stop(tmp_path) is None  # the repository itself: no hint
    assert not any("looks like a model folder" in r.getMessage() for r in caplog.records)
