"""Process isolation (``parameters: {execution: process}``) end to end: real worker
processes that really segfault or exit, a real server, tritonclient over HTTP and gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_process import start_serve
from tritonclient.utils import InferenceServerException

from appliance.backends import process_worker
from appliance.errors import ApplianceError
from devtools import modelgen

CRASHY_PY = """
import ctypes
import os
import time

import numpy as np

from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if (x == 1).any():
                ctypes.string_at(0)  # a segfault in native code
            if (x == 2).any():
                os._exit(1)
            if (x == 3).any():
                time.sleep(60)  # a hang: execute_timeout_s kills the process
            fds = []
            for n in os.listdir("/proc/self/fd"):
                try:
                    fds.append(os.readlink(f"/proc/self/fd/{n}"))
                except OSError:  # the listing's own descriptor, closed by now
                    pass
            where = [os.getcwd().encode(), str(os.getpid()).encode(), "|".join(fds).encode()]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", x * 2),
                pb_utils.Tensor("WHERE", np.array(where, dtype=object)),
            ]))
        return responses
"""

CRASHY_CONFIG = """
backend: python
max_batch_size: 0
parameters:
  execution: process
  process_max_failures: "{failures}"
  process_restart_backoff_s: "{backoff}"
{timeout}input:
  - {{name: IN, data_type: TYPE_FP32, dims: [-1]}}
output:
  - {{name: OUT, data_type: TYPE_FP32, dims: [-1]}}
  - {{name: WHERE, data_type: TYPE_STRING, dims: [3]}}
"""

TYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
TYPES += ("FP16", "FP32", "FP64", "BYTES")

ECHO_PY = """
from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            tensors = [pb_utils.Tensor(t.name().replace("IN_", "OUT_"), t.as_numpy())
                       for t in request.inputs()]
            out.append(pb_utils.InferenceResponse(tensors))
        return out
"""


def _echo_config(execution: str) -> str:
    tensors = [
        {"name": f"{kind}_{t}", "data_type": "TYPE_STRING" if t == "BYTES" else f"TYPE_{t}"}
        for kind in ("IN", "OUT")
        for t in TYPES
    ]
    for tensor in tensors:
        tensor["dims"] = [-1]
    config = {
        "backend": "python",
        "max_batch_size": 4,
        "parameters": {"execution": execution},
        "input": [t for t in tensors if t["name"].startswith("IN")],
        "output": [t for t in tensors if t["name"].startswith("OUT")],
    }
    return json.dumps(config)  # JSON is YAML


def _crashy_config(failures: int, backoff: float, timeout_s: float = 0) -> str:
    timeout = f'  execute_timeout_s: "{timeout_s}"\n' if timeout_s else ""
    return CRASHY_CONFIG.format(failures=failures, backoff=backoff, timeout=timeout)


def _python_model(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (repo / name / "config.yaml").write_text(config)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    _python_model(root, "crashy", CRASHY_PY, _crashy_config(5, 0.5))
    # three consecutive failures give up; a long backoff keeps the window deterministic
    _python_model(root, "fragile", CRASHY_PY, _crashy_config(3, 300))
    _python_model(root, "sleepy", CRASHY_PY, _crashy_config(5, 0.5, timeout_s=3))
    _python_model(root, "echo_in", ECHO_PY, _echo_config("in_process"))
    _python_model(root, "echo_proc", ECHO_PY, _echo_config("process"))
    modelgen.write_model(root, "simple", modelgen.simple_add_sub())
    # ONNX Runtime in a worker process (any backend can be isolated), set in Triton's pbtxt
    folder = modelgen.write_model(root, "simple_proc", modelgen.simple_add_sub())
    (folder / "config.pbtxt").write_text(
        'parameters { key: "execution" value { string_value: "process" } }\n'
    )
    return root


def _crashy(client: httpclient.InferenceServerClient, value: float, model: str = "crashy") -> Any:
    x = httpclient.InferInput("IN", [2], "FP32")
    x.set_data_from_numpy(np.array([value, 5], np.float32))
    return client.infer(model, [x])


def _pids(srv: Any, model: str) -> list[int]:
    mv = srv.server.lifecycle.get(model)
    return [i.backend.pid for i in mv._instances.instances]


def _gone(pid: int) -> bool:
    """The process neither runs nor lingers as a zombie (it was reaped)."""
    return not Path(f"/proc/{pid}").exists()


def test_a_crash_fails_its_request_and_the_model_comes_back(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["crashy", "simple"])
    client = httpclient.InferenceServerClient(srv.url)
    first = _crashy(client, 3.5)
    np.testing.assert_array_equal(first.as_numpy("OUT"), [7, 10])
    (pid,) = _pids(srv, "crashy")
    assert int(first.as_numpy("WHERE")[1]) == pid != os.getpid()
    for value, how in ((1, "signal 11 (SIGSEGV)"), (2, "exit code 1")):
        with pytest.raises(InferenceServerException) as failed:
            _crashy(client, value)
        assert failed.value.status() == "500"
        assert f"model instance process died: {how}" in str(failed.value)
        # the server, its other models and endpoints are untouched
        assert client.is_server_live()
        simple = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in simple:
            tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
        np.testing.assert_array_equal(client.infer("simple", simple).as_numpy("OUTPUT0"), 2)
        # and the next request to the same model succeeds, in a new process
        again = _crashy(client, 4)
        np.testing.assert_array_equal(again.as_numpy("OUT"), [8, 10])
        assert _gone(pid)
        (new,) = _pids(srv, "crashy")
        assert new != pid and int(again.as_numpy("WHERE")[1]) == new
        pid = new
    assert client.is_model_ready("crashy")


def test_grpc_reports_a_crash_as_internal(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["crashy"])
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    x = grpcclient.InferInput("IN", [1], "FP32")
    x.set_data_from_numpy(np.array([1], np.float32))
    with pytest.raises(InferenceServerException) as failed:
        client.infer("crashy", [x])
    assert failed.value.status() == "StatusCode.INTERNAL"
    assert "model instance process died: signal 11" in str(failed.value)
    x.set_data_from_numpy(np.array([6], np.float32))
    np.testing.assert_array_equal(client.infer("crashy", [x]).as_numpy("OUT"), [12])


def test_a_hang_is_ended_by_killing_the_process(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["sleepy"])
    client = httpclient.InferenceServerClient(srv.url, network_timeout=60)
    (pid,) = _pids(srv, "sleepy")
    with pytest.raises(InferenceServerException) as failed:
        _crashy(client, 3, "sleepy")
    assert failed.value.status() == "503"
    assert "did not finish within 3s; its process was killed" in str(failed.value)
    assert _gone(pid)
    np.testing.assert_array_equal(_crashy(client, 4, "sleepy").as_numpy("OUT"), [8, 10])


def test_a_crash_loop_backs_off_then_gives_up(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["fragile"])
    client = httpclient.InferenceServerClient(srv.url)
    with pytest.raises(InferenceServerException, match="it is being restarted"):
        _crashy(client, 1, "fragile")
    with pytest.raises(InferenceServerException, match="restarting in 30s") as second:
        _crashy(client, 1, "fragile")  # the first restart was immediate
    assert second.value.status() == "500"
    # within the backoff window requests fail fast as unavailable
    with pytest.raises(InferenceServerException, match="is restarted in") as waiting:
        _crashy(client, 4, "fragile")
    assert waiting.value.status() == "503"
    assert client.is_model_ready("fragile")
    # the third consecutive failure gives up; the server loads the model again itself
    # (core/recovery.py), so it answers again with no one asking
    backend = srv.server.lifecycle.get("fragile")._instances.instances[0].backend
    backend._retry_at = 0.0  # the 30 s window, skipped rather than waited for
    with pytest.raises(InferenceServerException, match="gave up after 3 consecutive"):
        _crashy(client, 1, "fragile")

    def replaced() -> bool:
        try:
            copy = srv.server.lifecycle.get("fragile")
        except ApplianceError:  # (being replaced in place: no copy for a moment)
            return False
        return copy.ready and copy._instances.instances[0].backend is not backend

    deadline = time.monotonic() + 60  # a bound for a hang, not a timing assertion
    while not replaced():
        assert time.monotonic() < deadline, "the model was not loaded again"
        time.sleep(0.05)
    assert client.is_model_ready("fragile")
    np.testing.assert_array_equal(_crashy(client, 4, "fragile").as_numpy("OUT"), [8, 10])


def _dtype(datatype: str) -> np.dtype[Any]:
    if datatype == "BYTES":
        return np.dtype(object)
    return np.dtype(datatype.lower().replace("fp", "float"))


def _input(name: str, datatype: str, arr: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(arr.shape), datatype)
    tensor.set_data_from_numpy(arr, binary_data=True)
    return tensor


def _echo(client: httpclient.InferenceServerClient, model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    inputs = []
    for t in TYPES:
        if t == "BYTES":
            arr = np.array([[b"", b"\x00\xffbin"], [b"caf\xc3\xa9", b"x" * 300]], dtype=object)
        else:
            arr = rng.integers(0, 2 if t == "BOOL" else 100, (2, 2)).astype(_dtype(t))
        inputs.append(_input(f"IN_{t}", t, arr))
    result = client.infer(model, inputs)
    return {t: result.as_numpy(f"OUT_{t}") for t in TYPES}


def test_results_equal_in_process_results_for_every_datatype(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["echo_in", "echo_proc", "simple", "simple_proc"])
    client = httpclient.InferenceServerClient(srv.url)
    local, isolated = _echo(client, "echo_in"), _echo(client, "echo_proc")
    for t in TYPES:
        assert isolated[t].dtype == local[t].dtype, t
        np.testing.assert_array_equal(isolated[t], local[t], err_msg=t)
    assert list(local["BYTES"].ravel()) == [b"", b"\x00\xffbin", b"caf\xc3\xa9", b"x" * 300]
    # a large tensor grows the shared segment beyond its first size, in both directions
    big = httpclient.InferInput("IN_FP32", [1, 3 * 2**20], "FP32")
    data = np.arange(3 * 2**20, dtype=np.float32)[None]
    big.set_data_from_numpy(data)
    others = [t for t in TYPES if t != "FP32"]
    small = [httpclient.InferInput(f"IN_{t}", [1, 0], t) for t in others]
    for tensor, t in zip(small, others, strict=True):
        empty = np.zeros((1, 0), dtype=object if t == "BYTES" else np.dtype(bool))
        tensor.set_data_from_numpy(empty if t in ("BYTES", "BOOL") else empty.astype(
            np.dtype(t.lower().replace("fp", "float"))))
    result = client.infer("echo_proc", [big, *small])
    np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    assert result.as_numpy("OUT_INT8").shape == (1, 0)
    # ONNX Runtime hosted in a worker process answers as it does in the server
    assert all(_pids(srv, "simple_proc"))
    simple = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i, tensor in enumerate(simple):
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32)[None] * (i + 1))
    for name in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(
            client.infer("simple_proc", simple).as_numpy(name),
            client.infer("simple", simple).as_numpy(name),
        )


def test_the_worker_is_confined(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["crashy"])
    client = httpclient.InferenceServerClient(srv.url)
    cwd, _, fds = _crashy(client, 4).as_numpy("WHERE")
    assert Path(cwd.decode()) == (repo / "crashy").resolve()
    # its control socket, its tensor segment (mapped: mmap holds a second descriptor),
    # stdin from /dev/null and the server's stdout and stderr; nothing else of the server
    links = fds.decode().split("|")
    stdio = {os.readlink(f"/proc/self/fd/{n}") for n in (1, 2)}
    assert sum(link.startswith("socket:") for link in links) == 1, links
    assert "/memfd:appliance-tensors (deleted)" in links, links
    others = set(links) - stdio - {"/dev/null", "/memfd:appliance-tensors (deleted)"}
    assert len(others) == 1 and others.pop().startswith("socket:"), links
    # a model file outside the model folder it was given is refused by the worker
    message = {"root": str(repo / "crashy"), "backend": "python", "options": {}}
    message["options"]["model_path"] = str(repo / "echo_in" / "1" / "model.py")
    with pytest.raises(ApplianceError, match="outside the model folder"):
        process_worker._options(message)
    message["options"]["model_path"] = str(repo / "crashy" / ".." / "simple" / "1" / "model.onnx")
    with pytest.raises(ApplianceError, match="outside the model folder"):
        process_worker._options(message)


def test_unload_and_stop_end_the_workers(run_appliance, repo: Path) -> None:
    srv = run_appliance(repo, load_model=["crashy", "echo_proc"])
    client = httpclient.InferenceServerClient(srv.url)
    crashy, echo = _pids(srv, "crashy"), _pids(srv, "echo_proc")
    assert not any(_gone(p) for p in crashy + echo)
    client.unload_model("crashy")
    assert all(_gone(p) for p in crashy)
    assert not any(_gone(p) for p in echo)
    srv.stop()
    assert all(_gone(p) for p in echo)  # reaped too: a zombie would keep its /proc entry


def test_execution_settings_are_validated(run_appliance, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    bad = {
        "execution": "sandbox",
        "process_max_failures": "0",
        "process_restart_backoff_s": "soon",
    }
    for i, (key, value) in enumerate(bad.items()):
        params = {"execution": "process", key: value}
        config = json.dumps({"parameters": params})
        modelgen.write_model(repo, f"bad{i}", modelgen.simple_add_sub(), config)
    # a model whose initialize crashes its worker: the load fails, saying how
    init_crash = "import ctypes\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
    init_crash += "        ctypes.string_at(0)\n"
    _python_model(repo, "init_crash", init_crash, _crashy_config(5, 1))
    srv = run_appliance(repo, load_model=[])
    expected = {f"bad{i}": f"parameters.{key}" for i, key in enumerate(bad)}
    expected["init_crash"] = "the worker process died while loading: signal 11 (SIGSEGV)"
    for model, message in expected.items():
        request = urllib.request.Request(
            f"http://{srv.url}/v2/repository/models/{model}/load", data=b"{}", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=60)
        assert failed.value.code == 400
        assert message in failed.value.read().decode()


def _state(pid: int) -> str:
    """The process state letter ('' when gone): 'Z' is a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _exited(pid: int) -> bool:
    """The process has finished dying: its leader is a zombie (or reaped) and no other
    thread of it still runs. A killed multi-threaded process shows 'Z' for its leader
    while its other threads are still exiting, and only the last one out closes its
    files (the socket to the server) - until then it is not gone yet."""
    if _state(pid) not in ("Z", ""):
        return False
    try:
        return [t.name for t in Path(f"/proc/{pid}/task").iterdir()] in ([], [str(pid)])
    except OSError:
        return True


def _wait_until(check: Any, seconds: float = 20.0) -> bool:
    """Poll ``check`` (bounded); a liveness wait, not a timing assertion."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def test_a_worker_killed_while_idle_is_replaced_before_the_next_request(
    run_appliance, repo: Path
) -> None:
    srv = run_appliance(repo, load_model=["crashy"])
    client = httpclient.InferenceServerClient(srv.url)
    (pid,) = _pids(srv, "crashy")
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    assert _wait_until(lambda: _exited(pid))
    # nothing was in flight: this request is served by the successor
    result = _crashy(client, 4)
    np.testing.assert_array_equal(result.as_numpy("OUT"), [8, 10])
    assert int(result.as_numpy("WHERE")[1]) != pid and _gone(pid)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_workers_exit_when_the_server_is_killed(repo: Path) -> None:
    ports = ["--http-port", "0", "--grpc-port", "-1", "--metrics-port", "-1"]
    ports += ["--load-model", "crashy", "--load-model", "echo_proc"]
    server = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--model-repository", str(repo), *ports],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        for line in server.stderr:  # bounded by the server's own start-up
            if "ready in" in line:
                break
        workers = _children(server.pid)
        assert len(workers) == 2, workers  # crashy's and echo_proc's
    finally:
        server.kill()
        server.wait()
    assert _wait_until(lambda: all(_state(p) in ("Z", "") for p in workers)), [
        (p, _state(p)) for p in workers
    ]


@pytest.mark.parametrize("how", ["flag", "config"])
def test_a_relative_repository_works_with_process_isolation(repo: Path, how: str) -> None:
    """The worker runs in the model's folder: paths relative to the server's working
    directory (a relative --model-repository, or a relative config file whose
    model_repository is relative to it) must still find the model file."""
    work = repo.parent
    if how == "flag":
        where = ["--model-repository", repo.name]
    else:
        (work / "appliance.yaml").write_text(f"model_repository: ./{repo.name}\n")
        where = ["--config", "appliance.yaml"]
    loads = ["--load-model", "simple_proc", "--load-model", "echo_proc"]
    proc, port, lines = start_serve(*where, "--grpc-port", "-1", *loads, cwd=work)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_model_ready("simple_proc") and client.is_model_ready("echo_proc"), lines
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for t in inputs:
            t.set_data_from_numpy(a)
        np.testing.assert_array_equal(
            client.infer("simple_proc", inputs).as_numpy("OUTPUT0"), a + a
        )
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
