"""``appliance doctor`` on real repositories, real sockets and a real broker address."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from appliance import doctor
from appliance.cli import build_parser
from appliance.config.server_config import load_server_config
from devtools import modelgen

ROOT = Path(__file__).resolve().parent.parent


def _doctor(*args: str) -> tuple[int, dict[str, dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "doctor", "--json", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, {c["name"]: c for c in json.loads(done.stdout)}


def _checks(*args: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """The same checks in this process (the CLI's JSON shape, without a subprocess)."""
    parsed = build_parser().parse_args(["doctor", *args])
    checks = doctor.run_checks(
        parsed.config, parsed.ota_url, parsed.timeout, parsed.model_repository
    )
    code = 1 if any(c.status == "fail" for c in checks) else 0
    return code, {c.name: asdict(c) for c in checks}


def _config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "appliance.yaml"
    path.write_text(
        "model_repository: models\nhttp_port: 0\ngrpc_port: 0\nmetrics_port: 0\n" + extra
    )
    return path


def test_a_healthy_setup_passes(tmp_path: Path) -> None:
    modelgen.write_model(tmp_path / "models", "simple", modelgen.simple_add_sub())
    code, checks = _doctor("--config", str(_config(tmp_path)))
    assert code == 0, checks
    assert checks["config"]["status"] == "ok"
    assert checks["models"]["details"]["models"]["simple"] == "onnxruntime, version(s) [1]"
    assert "onnxruntime" in checks["engines"]["details"]["installed"]
    assert "CPUExecutionProvider" in checks["engines"]["details"]["onnxruntime_providers"]
    assert checks["platform"]["details"]["arch"]


def test_the_repository_serve_was_given_is_the_one_checked(tmp_path: Path) -> None:
    """``--model-repository`` as ``serve`` takes it: alone (the demo models otherwise),
    and over the config's own repository."""
    mine = tmp_path / "mine"
    modelgen.write_model(mine, "mymodel", modelgen.simple_add_sub())
    code, checks = _doctor("--model-repository", str(mine))
    assert code == 0, checks
    assert list(checks["models"]["details"]["models"]) == ["mymodel"]
    config = _config(tmp_path)  # its models/ folder does not exist
    code, checks = _checks("--config", str(config), "--model-repository", str(mine))
    assert code == 0 and list(checks["models"]["details"]["models"]) == ["mymodel"], checks


def test_a_model_whose_memory_would_be_a_lower_bound_is_named(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    frame = modelgen.frame_mean()
    dynamic = "input: [{name: frame, data_type: TYPE_UINT8, dims: [-1, -1, 3]}]\n"
    modelgen.write_model(repo, "camera", frame, dynamic)
    modelgen.write_model(repo, "fixed", frame, dynamic.replace("-1, -1", "480, 640"))
    code, checks = _checks("--config", str(_config(tmp_path)))
    rows = checks["models"]["details"]["models"]
    assert code == 0 and checks["models"]["status"] == "ok"  # a note, not a failure
    assert rows["camera"] == (
        "onnxruntime, version(s) [1]; memory is a lower bound: declare a model_warmup "
        "(input 'frame' [-1, -1, 3] is measured with each dynamic dim at 1)"
    )
    assert rows["fixed"] == "onnxruntime, version(s) [1]"


def test_what_would_fail_to_load_is_named_with_the_reason(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    modelgen.write_model(repo, "good", modelgen.simple_add_sub())
    modelgen.write_model(repo, "typo", modelgen.simple_add_sub(), "max_batch_sise: 4\n")
    (repo / "empty" / "1").mkdir(parents=True)  # a version folder without a model file
    (repo / "pipe").mkdir()
    (repo / "pipe" / "config.yaml").write_text(
        "platform: ensemble\nmax_batch_size: 0\n"
        "input: [{name: A, data_type: TYPE_INT32, dims: [16]}]\n"
        "output: [{name: B, data_type: TYPE_INT32, dims: [16]}]\n"
        "ensemble_scheduling:\n  step:\n  - model_name: nowhere\n    model_version: -1\n"
        "    input_map: {X: A}\n    output_map: {Y: B}\n"
    )
    code, checks = _checks("--config", str(_config(tmp_path)))
    assert code == 1
    models = checks["models"]
    assert models["status"] == "fail" and "3 would fail" in models["summary"]
    rows = models["details"]["models"]
    assert rows["good"].startswith("onnxruntime")
    assert rows["typo"].startswith("WOULD FAIL") and "did you mean max_batch_size?" in rows["typo"]
    assert rows["empty"].startswith("WOULD FAIL") and "no model file" in rows["empty"]
    assert rows["pipe"].startswith("WOULD FAIL") and "'nowhere'" in rows["pipe"]


def test_an_invalid_config_fails_and_the_rest_still_runs(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("memory_limit: 60\n")
    code, checks = _checks("--config", str(path))
    assert code == 1
    assert checks["config"]["status"] == "fail" and "needs a unit" in checks["config"]["summary"]
    assert checks["clock"]["status"] == "ok" and checks["engines"]["status"] == "ok"


def test_ports_in_use_and_an_unreachable_broker(tmp_path: Path) -> None:
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port, dead = busy.getsockname()[1], closed.getsockname()[1]
        modelgen.write_model(tmp_path / "models", "simple", modelgen.simple_add_sub())
        extra = f"mqtt: {{host: 127.0.0.1, port: {dead}}}\n"
        config = _config(tmp_path, extra).read_text().replace("http_port: 0", f"http_port: {port}")
        (tmp_path / "appliance.yaml").write_text(config)
        code, checks = _checks("--config", str(tmp_path / "appliance.yaml"), "--timeout", "5")
    assert code == 1
    assert checks["ports"]["status"] == "fail" and f"http {port}" in checks["ports"]["summary"]
    assert checks["network"]["status"] == "warn"
    assert "mqtt broker" in checks["network"]["summary"]


def test_a_reachable_ota_source(tmp_path: Path) -> None:
    config = load_server_config(None, {"http_port": 0, "grpc_port": 0, "metrics_port": 0})
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/repo"
        check = doctor.check_reachability(config, url, timeout=5)
    assert check.status == "ok" and check.details == {"ota source": "reachable"}


def test_clock_behind_the_installed_software_fails() -> None:
    assert doctor.check_clock(reference=time.time() + 30 * 86400).status == "fail"
    assert doctor.check_clock(reference=time.time() - 86400).status == "ok"


def test_l4t_release_and_memory_budget() -> None:
    text = "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64\n"
    assert doctor.l4t_release(text) == "R36.4.0"
    assert doctor.l4t_release("") == ""
    too_big = load_server_config(None, {"memory_limit": "100000GiB"})
    assert doctor.check_memory(too_big).status == "fail"


def test_human_output_is_one_line_per_check(tmp_path: Path) -> None:
    modelgen.write_model(tmp_path / "models", "simple", modelgen.simple_add_sub())
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "doctor", "--config", str(_config(tmp_path))],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    names = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("[")]
    assert names == [
        "platform",
        "engines",
        "gpu",
        "device",
        "config",
        "memory",
        "models",
        "ports",
        "network",
        "clock",
    ]


def test_device_summary_over_recorded_trees(tmp_path: Path) -> None:
    from device_trees import JETSON, X86, writable

    check = doctor.check_device(str(JETSON))
    assert check.status == "ok"
    assert check.summary == (
        "cpu 48.5 C, gpu 47.2 C, soc 48.4 C, junction 48.5 C; VDD_IN 6.94 W; "
        "power mode 15W (id 0); gpu 17000000.gpu 31% busy; no throttling"
    )
    assert "INA3221 rails (VDD_IN, VDD_CPU_GPU_CV, VDD_SOC)" in check.details["sources"]
    root = writable(JETSON, tmp_path)
    (root / "sys/class/hwmon/hwmon3/oc3_event_cnt").write_text("37\n")
    check = doctor.check_device(str(root))
    assert check.status == "warn" and check.summary.endswith("37 oc3 throttle events since boot")
    assert doctor.check_device(str(X86)).summary.startswith("cpu 41.0 C, board 27.8 C")
    assert doctor.check_device(str(tmp_path / "nothing")).summary.startswith("no device")


def _with_ir(ir_version: int | None = None, opset: int | None = None) -> bytes:
    """The simple model as the installed onnx package saves it (its own IR version by
    default), or stamped with another IR version or opset."""
    import onnx

    model = onnx.load_from_string(modelgen.simple_add_sub())
    model.ir_version = onnx.IR_VERSION if ir_version is None else ir_version
    if opset is not None:
        model.opset_import[0].version = opset
    return model.SerializeToString()  # type: ignore[no-any-return]


def test_models_the_engine_would_refuse_are_named_as_serve_names_them(
    tmp_path: Path, run_appliance: Any
) -> None:
    """doctor parses each model file with the engine that would serve it: random bytes,
    an IR version or opset newer than the installed ONNX Runtime reads; and a model as
    the installed onnx saves it (IR 14 today: read by ONNX Runtime 1.32 on Python 3.11,
    refused by 1.23 on 3.10) gets the same verdict from doctor and from serve."""
    import onnxruntime

    repo = tmp_path / "models"
    modelgen.write_model(repo, "good", modelgen.simple_add_sub())
    modelgen.write_model(repo, "noise", os.urandom(4096))
    modelgen.write_model(repo, "future_ir", _with_ir(99))
    modelgen.write_model(repo, "future_opset", _with_ir(8, opset=99))
    modelgen.write_model(repo, "as_saved", _with_ir())
    _, checks = _checks("--config", str(_config(tmp_path)))
    rows = checks["models"]["details"]["models"]
    assert rows["good"] == "onnxruntime, version(s) [1]"
    assert rows["noise"].startswith("WOULD FAIL: version 1:")
    assert "Protobuf parsing" in rows["noise"]
    installed = f"ONNX Runtime {onnxruntime.__version__}"
    assert "the model is ONNX IR version 99" in rows["future_ir"]
    assert f"{installed} reads IR <=" in rows["future_ir"] and "save it at IR" in rows["future_ir"]
    assert "opset 99 of ai.onnx" in rows["future_opset"]

    srv = run_appliance(repo, grpc_port=-1, metrics_port=-1)
    served = {m["name"]: m for m in srv.server.lifecycle.index()}
    for name, row in rows.items():
        refused = row.startswith("WOULD FAIL")
        assert (served[name]["state"] != "READY") == refused, (name, row, served[name])
    assert "the model is ONNX IR version 99" in served["future_ir"]["reason"]
    assert f"{installed} reads IR <=" in served["future_ir"]["reason"]


def test_a_sealed_model_is_not_parsed_as_plain_bytes(tmp_path: Path) -> None:
    """A model encrypted at rest opens only with the server's key: doctor names it
    sealed instead of calling its ciphertext a model the engine would refuse."""
    from appliance.backends import sealed_crypto

    public = sealed_crypto.parse_public(sealed_crypto.generate_key(tmp_path / "device.key"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.onnx").write_bytes(modelgen.simple_add_sub())
    repo = tmp_path / "models"
    sealed_crypto.seal_folder(tmp_path / "plain", repo / "locked" / "1", [public])
    _, checks = _checks("--config", str(_config(tmp_path)))
    row = checks["models"]["details"]["models"]["locked"]
    assert row.startswith("onnxruntime, version(s) [1]") and "sealed version(s) [1]" in row


def test_the_grpc_port_is_off_when_grpc_cannot_load(tmp_path: Path) -> None:
    """Not "grpc 8001 free" when grpcio is missing: a warning for the default port (serve
    goes on without it), a failure for a port asked for (serve stops at start)."""
    modelgen.write_model(tmp_path / "models", "simple", modelgen.simple_add_sub())
    default = tmp_path / "default.yaml"
    default.write_text("model_repository: models\nhttp_port: 0\nmetrics_port: 0\n")
    blocked = "import sys; sys.modules['grpc'] = None\nfrom appliance.cli import main\n"
    results = {}
    for config in (default, _config(tmp_path)):
        done = subprocess.run(
            [sys.executable, "-c", blocked + "sys.exit(main(sys.argv[1:]))", "doctor",
             "--json", "--config", str(config)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        results[config.name] = {c["name"]: c for c in json.loads(done.stdout)}["ports"]
    for name, status in (("default.yaml", "warn"), ("appliance.yaml", "fail")):
        ports = results[name]
        assert ports["status"] == status, ports
        assert ports["details"]["grpc"].startswith("off: the gRPC libraries do not load")
        assert "pip install 'appliance[grpc]'" in ports["details"]["grpc"]
        assert "free" not in ports["details"]["grpc"]


def test_the_ota_source_of_the_config_is_checked(tmp_path: Path) -> None:
    modelgen.write_model(tmp_path / "models", "simple", modelgen.simple_add_sub())
    with socket.socket() as server, socket.socket() as closed:
        server.bind(("127.0.0.1", 0))
        server.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        up, down = server.getsockname()[1], closed.getsockname()[1]
        verdicts = {}
        for port in (up, down):
            ota = (
                f"ota: {{source: 'http://127.0.0.1:{port}/repo', trusted_root: root.json, "
                f"state_dir: state, device_id: cam-1}}\n"
            )
            _, checks = _checks("--config", str(_config(tmp_path, ota)), "--timeout", "5")
            assert checks["ota"]["status"] == "ok", checks["ota"]
            assert checks["ota"]["details"]["source"] == f"http://127.0.0.1:{port}/repo/"
            verdicts[port] = checks["network"]
    assert verdicts[up]["status"] == "ok" and verdicts[up]["details"] == {
        "ota source": "reachable"
    }
    assert verdicts[down]["status"] == "warn" and "ota source" in verdicts[down]["summary"]
    _, checks = _checks("--config", str(_config(tmp_path, "ota: {source: ftp://x}\n")))
    assert checks["ota"]["status"] == "fail" and "ota.source" in checks["ota"]["summary"]
    _, checks = _checks("--config", str(_config(tmp_path)))
    assert "ota" not in checks and checks["network"]["summary"] == (
        "no broker or OTA source configured"
    )
