"""Without the gRPC libraries: what the default install and the ``ota`` extra are for
still works, and what needs gRPC says so in one line.

Each command runs in its own Python process where ``import grpc`` fails, either as
on an install without grpcio (the module is absent) or as after a ``pip install``
that left grpcio's generated code and the protobuf runtime mismatched (the import
raises protobuf's VersionError). The install matrix (tests/test_install_matrix.py)
does the same with real installs of each extra.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ota_helpers import vectors
from serve_process import ROOT, startup_lines

from appliance.config.model_config import parse_model_config
from appliance.config.triton_config import pbtxt_to_dict
from devtools import modelgen

# ``import grpc`` raises ModuleNotFoundError, as on an install without grpcio
ABSENT = """
import sys
for _name in ("grpc", "grpc_health"):
    sys.modules[_name] = None
"""
# ``import grpc`` raises protobuf's VersionError, as after pip moved protobuf under it
MISMATCHED = """
import sys
from google.protobuf.runtime_version import VersionError

class _Mismatched:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith("grpc."):
            raise VersionError(
                "Detected incompatible Protobuf Gencode/Runtime versions when loading "
                "grpc_health/v1/health.proto: gencode 7.36.2 runtime 6.33.6."
            )
        return None

sys.meta_path.insert(0, _Mismatched())
"""
MAIN = "\nfrom appliance.cli import main\nsys.exit(main(sys.argv[1:]))\n"
FIX = "pip install 'appliance[grpc]'"


def _env() -> dict[str, str]:
    import os

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def python(prelude: str, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=180,
    )


def appliance(prelude: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``appliance ARGS`` in a process where grpc cannot import."""
    return python(prelude, MAIN, *args, cwd=cwd)


@pytest.mark.parametrize("prelude", [ABSENT, MISMATCHED], ids=["absent", "mismatched"])
def test_the_preludes_stop_grpc_from_importing(prelude: str, tmp_path: Path) -> None:
    done = python(prelude, "\nimport grpc\n", cwd=tmp_path)
    assert done.returncode != 0
    assert ("ModuleNotFoundError" if prelude is ABSENT else "VersionError") in done.stderr


FLEET = """
import contextlib, io, json, sys
from appliance.cli import main

results = []
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(command)
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


def test_the_readme_fleet_commands_run_without_grpc(tmp_path: Path) -> None:
    """The README's fleet and bundle commands, as the ``ota`` extra installs them (one
    process runs them all, as a fleet script would)."""
    src = modelgen.write_model(
        tmp_path / "models", "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG, 2
    )
    (tmp_path / "vectors.json").write_text(json.dumps(vectors()))
    commands = [
        ["fleet", "keys", "fleet/keys"],
        ["fleet", "init", "fleet/repo", "--keys", "fleet/keys"],
        ["bundle", "build", str(src), "--version", "2", "-o", "simple-2.bundle",
         "--self-test", "vectors.json"],
        ["bundle", "inspect", "simple-2.bundle"],
        ["fleet", "publish", "fleet/repo", "simple-2.bundle", "--keys", "fleet/keys",
         "--percent", "0", "--group", "gate"],
        ["fleet", "rollout", "fleet/repo", "simple", "--percent", "100", "--keys", "fleet/keys"],
    ]  # fmt: skip
    done = python(ABSENT, FLEET, json.dumps(commands), cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    results = json.loads(done.stdout)
    assert [code for code, _ in results] == [0] * len(commands), done.stderr
    assert json.loads(results[3][1])["version"] == 2


CONFIG_ROUND_TRIP = """
import json, sys
from pathlib import Path
from appliance.config.triton_config import to_triton_json
from appliance.config.reader import load_model_config
from appliance.perf.tune import render
from appliance.ota import install

repo = Path(sys.argv[1])
config = install.on_disk(repo, "simple")            # config.yaml read, as Triton JSON
install.write_config(repo, "simple", install.with_versions(config, [1]))  # the agent
Path(sys.argv[2]).write_text(render(config, "pbtxt", "tuned"))           # tune --output
print(json.dumps(to_triton_json(load_model_config(repo / "simple"))))
"""


def test_model_configs_are_read_and_written_without_grpc(tmp_path: Path) -> None:
    """The OTA agent's config.pbtxt and ``appliance tune --output X.pbtxt``."""
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    tuned = tmp_path / "tuned.pbtxt"
    done = python(ABSENT, CONFIG_ROUND_TRIP, str(repo), str(tuned), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (repo / "simple" / "config.yaml").exists()
    written = json.loads(done.stdout)
    assert written["version_policy"] == {"specific": {"versions": [1]}}
    assert [t["name"] for t in written["input"]] == ["INPUT0", "INPUT1"]
    again = parse_model_config(pbtxt_to_dict(tuned.read_text(), "tuned"), "simple", "tuned")
    assert again.max_batch_size == written["max_batch_size"]


def test_tune_writes_pbtxt_without_grpc(run_appliance: Any, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "simple", modelgen.simple_add_sub(), modelgen.SIMPLE_CONFIG)
    srv = run_appliance(repo, grpc_port=-1, model_control_mode="explicit", load_model=["simple"])
    done = appliance(
        ABSENT, "tune", "simple", "-u", srv.url, "--max-batch-sizes", "1", "--max-instances", "1",
        "--warmup", "0.1", "--duration", "0.3", "--output", "simple.pbtxt", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "simple.pbtxt").read_text()
    assert parse_model_config(pbtxt_to_dict(text, "simple.pbtxt"), "simple", "x").inputs


def test_perf_over_grpc_without_its_libraries_exits_2(run_appliance: Any, tmp_path: Path) -> None:
    srv = run_appliance(grpc_port=-1)
    done = appliance(
        ABSENT, "perf", "-m", "simple", "-u", srv.url, "-i", "grpc", "--warmup", "0.1",
        "--duration", "0.2", "--quiet", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("appliance perf: error: -i grpc needs the gRPC libraries")
    assert FIX in line


def _serve(prelude: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", prelude + MAIN, "serve", "--http-port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=_env(),
    )


@pytest.mark.parametrize("prelude", [ABSENT, MISMATCHED], ids=["absent", "mismatched"])
def test_the_default_grpc_port_turns_itself_off_with_a_warning(
    prelude: str, tmp_path: Path
) -> None:
    """The default port 8001 was not asked for: HTTP serves, the log says why gRPC is off
    and how to get it."""
    proc = _serve(prelude, "--metrics-port", "-1", cwd=tmp_path)
    lines = []
    try:
        lines += startup_lines(proc)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    (warning,) = [line for line in lines if "gRPC endpoint off" in line]
    assert "WARNING" in warning and "the gRPC libraries do not load" in warning and FIX in warning
    assert any("ready in" in line for line in lines), text
    assert "grpc " not in next(line for line in lines if "listening:" in line)


@pytest.mark.parametrize(
    ("prelude", "how"), [(ABSENT, "flag"), (MISMATCHED, "config")], ids=["absent", "mismatched"]
)
def test_a_grpc_port_asked_for_fails_the_start_in_one_line(
    prelude: str, how: str, tmp_path: Path
) -> None:
    """--grpc-port on the command line, or grpc_port: in the config file."""
    args = ["--grpc-port", "0"]
    if how == "config":
        (tmp_path / "appliance.yaml").write_text(yaml.safe_dump({"grpc_port": 0}))
        args = ["--config", "appliance.yaml"]
    proc = _serve(prelude, "--metrics-port", "-1", *args, cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "ERROR" in line]
    assert "cannot serve gRPC on port 0: the gRPC libraries do not load" in line
    assert FIX in line and "grpc_port: -1" in line
