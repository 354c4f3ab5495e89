"""Every documented install on its own: each extra in a fresh virtual environment,
running the commands that extra is for, as a user runs them (the installed
``appliance`` command, outside this checkout), and the deployment constraints
resolved for every supported Python.

- ``.``: serve (gRPC off by itself, with a warning), an HTTP inference, ``perf`` over
  HTTP, ``perf -i grpc`` (exit 2, one line), ``tune --output X.pbtxt``;
- ``.[grpc]``: serve with gRPC, a tritonclient.grpc inference, grpc.health.v1, ``perf
  -i grpc``; then ``pip install 'tritonclient[grpc]'`` changes nothing, gRPC serves;
- ``.[ota]``: the README's fleet and bundle commands;
- ``.[client]``: the README's client example (tritonclient.http) against this
  install's own server;
- ``.[openvino]``: an OpenVINO model served, ``perf`` over HTTP;
- ``.[streams]``: a camera stream (an H.264 file written with the extra's own PyAV)
  served from ``appliance.yaml``, its detections in a JSON-lines file.

The deployment constraints are resolved here for Python 3.12 and 3.13; the main Python
and 3.10 install with them for real (``scripts/test.sh``), where
tests/test_every_python.py checks every pin.

Slow (a fresh install each, from pip's cache): ``scripts/test.sh`` runs it as its own
step with APPLIANCE_INSTALL_MATRIX=1 and prints its time; the main run skips it. The
installs and resolutions all start at once, three at a time (pip waits on its index and
its cache as much as it computes), and each test takes its own when it is ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from cameras import BRIGHT_CONFIG, BRIGHT_MODEL, wait_for
from serve_process import startup_lines
from test_every_python import normal, pins
from test_readme import _blocks

from devtools.container_check import infer_simple

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    os.environ.get("APPLIANCE_INSTALL_MATRIX") != "1",
    reason="slow: scripts/test.sh runs it as its own step (APPLIANCE_INSTALL_MATRIX=1)",
)
# requires-python >= 3.10: 3.11 (the suite's) and 3.10 install for real in scripts/test.sh
PYTHONS = ("3.12", "3.13")
EXTRAS = ("", "grpc", "ota", "client", "openvino", "streams")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "appliance")


def _run(*argv: str | Path, cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return str(done.stdout)


def _clean_env() -> dict[str, str]:
    """This process's environment without what would let the checkout or this venv in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout as a wheel, built from a copy (the checkout may be read-only)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, src, cwd=src)
    (built,) = out.glob("appliance-*.whl")
    return built


@pytest.fixture(scope="module")
def prepared(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """Every install of the matrix and every resolution, started at once (three at a
    time: the default install and the resolutions first, then the extras, layered over the
    default install); a test takes its own with ``.result()``, which raises what went
    wrong there."""

    def venv(extra: str) -> Venv:
        folder = tmp_path_factory.mktemp(f"venv-{extra or 'base'}")
        return Venv(folder, wheel, extra, jobs[""].result() if extra else None)

    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs: dict[str, Future] = {}
        jobs[""] = pool.submit(venv, "")
        # the resolutions beside the default install: an extra's job would only wait for it
        for python in PYTHONS:
            jobs[python] = pool.submit(_resolve, python, wheel, tmp_path_factory.mktemp("resolve"))
        for extra in EXTRAS[1:]:
            jobs[extra] = pool.submit(venv, extra)
        yield jobs
        for job in jobs.values():
            job.cancel()


class Venv:
    """A fresh virtual environment with the package installed, with one extra or none.

    An extra's environment is layered over the default install's (``base``): its
    site-packages come after the environment's own on ``sys.path`` (a ``.pth`` file), as
    the dependencies every install has, unpacked once. pip installs the package into the
    environment itself (its ``appliance`` command runs this interpreter), then
    ``appliance[extra]`` with the constraints, resolving against the default install:
    what the extra adds goes into this environment, and it may not replace any of the
    default install's distributions (pip's install report is checked), so what each
    environment can import is that of ``pip install '.[extra]'`` alone."""

    def __init__(self, root: Path, wheel: Path, extra: str, base: Venv | None = None) -> None:
        self.root, self.work = root / "venv", root / "work"
        self.work.mkdir()
        _run(sys.executable, "-m", "venv", "--without-pip", self.root, cwd=root)
        self.python = self.root / "bin" / "python"
        (self.site,) = (self.root / "lib").glob("python*/site-packages")
        spec = f"appliance{f'[{extra}]' if extra else ''} @ {wheel.as_uri()}"
        # --no-compile: byte-compiling every dependency is a third of the install's time
        install = ("install", "-q", "--no-compile", "-c", ROOT / "constraints.txt")
        if base is None:
            self.pip(*install, spec)
            return
        (self.site / "default-install.pth").write_text(f"{base.site}\n")
        self.pip("install", "-q", "--no-compile", "--no-deps", "--ignore-installed", wheel)
        report = root / "report.json"
        self.pip(*install, "--report", report, spec)
        added = {normal(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
        replaced = added & {normal(p.name.split("-")[0]) for p in base.site.glob("*.dist-info")}
        assert not replaced, f"appliance[{extra}] replaced the default install's {replaced}"

    def pip(self, *args: str | Path) -> str:
        return _run(sys.executable, "-m", "pip", "--python", self.python, *args, cwd=self.work)

    def appliance(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.root / "bin" / "appliance"), *args],
            cwd=self.work,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if ok:
            assert done.returncode == 0, f"appliance {args}: {done.stdout}\n{done.stderr}"
        return done

    def py(self, code: str) -> str:
        return _run(self.python, "-c", code, cwd=self.work)

    def imports(self, module: str) -> bool:
        code = f"import importlib.util as u, sys; sys.exit(0 if u.find_spec({module!r}) else 1)"
        return subprocess.run([self.python, "-c", code], cwd=self.work).returncode == 0

    @contextlib.contextmanager
    def serve(self, *args: str) -> Iterator[tuple[int, list[str]]]:
        """``appliance serve`` (HTTP on a free port) while the block runs: its HTTP port
        and its log; stopped with SIGTERM afterwards, which must exit 0."""
        proc = subprocess.Popen(
            [str(self.root / "bin" / "appliance"), "serve", "--http-port", "0", *args],
            cwd=self.work,
            env=_clean_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        try:
            lines += startup_lines(proc)
            assert any("ready in" in line for line in lines), "".join(lines)
            (port,) = re.findall(r"listening: http://127\.0\.0\.1:(\d+)", "".join(lines))
            yield int(port), lines
            proc.send_signal(signal.SIGTERM)
            lines.append(proc.communicate(timeout=60)[1])
            assert proc.returncode == 0, "".join(lines)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "Traceback" not in "".join(lines)

    def package_dir(self) -> Path:
        """Where this install put the appliance package (its demo models are there)."""
        code = "import appliance, pathlib; print(pathlib.Path(appliance.__file__).parent)"
        return Path(self.py(code).strip())


def assert_all_pinned(env: Venv) -> None:
    """Every distribution the install brought is at its constraints.txt pin."""
    wanted = pins()
    installed = dict(line.split("==") for line in env.pip("freeze").split() if "==" in line)
    off = {n: v for n, v in installed.items() if n != "appliance" and wanted.get(normal(n)) != v}
    assert not off, f"installed but not pinned in constraints.txt: {off}"


FAST = ["--warmup", "0.1", "--duration", "0.3", "--quiet", "--concurrency", "2"]
SUM = [2 * i for i in range(16)]


def test_default_install(prepared: dict[str, Future]) -> None:
    env: Venv = prepared[""].result()
    assert not env.imports("grpc")
    assert_all_pinned(env)
    with env.serve("--metrics-port", "-1") as (port, lines):  # gRPC: the default 8001
        assert any("gRPC endpoint off" in line and "WARNING" in line for line in lines)
        assert infer_simple(port) == SUM
        url = f"127.0.0.1:{port}"
        env.appliance("perf", "-m", "simple", "-u", url, *FAST)
        refused = env.appliance("perf", "-m", "simple", "-u", url, "-i", "grpc", *FAST, ok=False)
        assert refused.returncode == 2 and "pip install 'appliance[grpc]'" in refused.stderr
        assert "Traceback" not in refused.stderr
        env.appliance(
            "tune", "simple", "-u", url, "--max-batch-sizes", "1", "--max-instances", "1",
            "--warmup", "0.1", "--duration", "0.3", "--output", "simple.pbtxt",
        )  # fmt: skip
    assert 'name: "INPUT0"' in (env.work / "simple.pbtxt").read_text()


GRPC_CALL = """
import sys
import numpy as np
import grpc
import tritonclient.grpc as grpcclient

url = sys.argv[1]
client = grpcclient.InferenceServerClient(url)
a = np.arange(16, dtype=np.int32).reshape(1, 16)
inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
for t in inputs:
    t.set_data_from_numpy(a)
print(client.infer("simple", inputs).as_numpy("OUTPUT0").tolist()[0])
with grpc.insecure_channel(url) as channel:  # grpc.health.v1 Check: SERVING
    assert channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10) == b"\\x08\\x01"
"""


def test_grpc_extra_and_tritonclient_grpc_beside_it(prepared: dict[str, Future]) -> None:
    env: Venv = prepared["grpc"].result()
    assert_all_pinned(env)
    (env.work / "call.py").write_text(GRPC_CALL)

    def serve_and_call() -> None:
        with env.serve("--metrics-port", "-1", "--grpc-port", "0") as (port, lines):
            (grpc_port,) = re.findall(r"grpc 127\.0\.0\.1:(\d+)", "".join(lines))
            url = f"127.0.0.1:{grpc_port}"
            out = _run(env.python, "call.py", url, cwd=env.work)
            assert json.loads(out.strip()) == SUM
            env.appliance("perf", "-m", "simple", "-u", f"127.0.0.1:{port}", "-i", "grpc",
                          "--grpc-url", url, *FAST)  # fmt: skip

    serve_and_call()
    before = env.pip("freeze", "--all")
    env.pip("install", "-q", "tritonclient[grpc]")  # a user adding the client on the device
    assert env.pip("freeze", "--all") == before  # pip had nothing to change
    env.pip("check")
    serve_and_call()


def test_ota_extra_runs_the_readme_fleet_commands(prepared: dict[str, Future]) -> None:
    """The fleet-side lines of the README's OTA sequence (tests/test_readme.py runs all
    of it over the default install plus this extra), with this extra alone."""
    env: Venv = prepared["ota"].result()
    assert not env.imports("grpc")
    demo = env.package_dir()
    shutil.copytree(
        demo / "demo_models" / "simple", env.work / "appliance" / "demo_models" / "simple"
    )
    shutil.copytree(ROOT / "configs" / "ota", env.work / "configs" / "ota")
    (block,) = _blocks("shell")
    ran = 0
    for line in block.splitlines():
        argv = shlex.split(line.split("#")[0])
        if argv[:2] in (["appliance", "fleet"], ["appliance", "bundle"]) and argv[2] != "watch":
            env.appliance(*argv[1:])
            ran += 1
    assert ran == 6
    shown = json.loads(env.appliance("bundle", "inspect", "simple-1.bundle").stdout)
    assert shown["version"] == 1 and "simple" in json.dumps(shown)


def test_client_extra_runs_the_readme_client_example(prepared: dict[str, Future]) -> None:
    env: Venv = prepared["client"].result()
    (example, *_) = _blocks("client")
    with env.serve("--metrics-port", "-1", "--grpc-port", "-1") as (port, _):
        out = env.py(example.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    assert [int(x) for x in re.findall(r"-?\d+", out)] == list(range(1, 17))


def test_openvino_extra_serves_an_openvino_model(prepared: dict[str, Future]) -> None:
    env: Venv = prepared["openvino"].result()
    demo = env.package_dir()
    model = env.work / "models" / "simple_ov"
    shutil.copytree(demo / "demo_models" / "simple", model)
    config = model / "config.yaml"
    openvino = "backend: openvino\ndefault_model_filename: model.onnx"  # OpenVINO reads ONNX
    config.write_text(config.read_text().replace("backend: onnxruntime", openvino))
    serving = env.serve("--model-repository", "models", "--metrics-port", "-1", "--grpc-port", "-1")
    with serving as (port, lines):
        assert any("backend openvino" in line for line in lines), "".join(lines)
        assert infer_simple(port, "simple_ov") == SUM
        env.appliance("perf", "-m", "simple_ov", "-u", f"127.0.0.1:{port}", *FAST)


WRITE_CLIP = """
import av, numpy as np
with av.open("clip.mp4", "w") as container:
    stream = container.add_stream("libx264", rate=10)
    stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
    for i in range(20):
        frame = av.VideoFrame.from_ndarray(np.full((120, 160, 3), 200, np.uint8), format="rgb24")
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))
"""
STREAMS_CONFIG = """
model_repository: models
vision: {detectors: {bright: {min_confidence: 0.1}}}
streams: [{name: clip, url: clip.mp4, fps: 10, jsonl: clip.jsonl}]
"""


def test_streams_extra_serves_a_camera_stream(prepared: dict[str, Future]) -> None:
    env: Venv = prepared["streams"].result()
    assert env.imports("av")
    env.py(WRITE_CLIP)
    model = env.work / "models" / "bright"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(BRIGHT_MODEL)
    (model / "config.pbtxt").write_text(BRIGHT_CONFIG)
    (model / "labels.txt").write_text("dark\nbright\n")
    (env.work / "appliance.yaml").write_text(STREAMS_CONFIG)
    lines = env.work / "clip.jsonl"
    with env.serve("--config", "appliance.yaml", "--metrics-port", "-1", "--grpc-port", "-1"):
        wait_for(lambda: lines.exists() and len(lines.read_text().splitlines()) >= 3, 60, "3")
    first = json.loads(lines.read_text().splitlines()[0])
    assert first["stream"] == "clip" and first["predictions"][0]["label"] == "bright"


def _interpreter(version: str) -> str | None:
    """A Python of ``version`` on this machine (pyenv's, or pythonX.Y on PATH)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}"))
    found += [w for w in [shutil.which(f"python{version}")] if w]
    check = f"import sys; sys.exit(sys.version_info[:2] != {tuple(map(int, version.split('.')))})"
    for candidate in found:
        if subprocess.run([candidate, "-c", check], capture_output=True).returncode == 0:
            return candidate
    return None


def _resolve(python: str, wheel: Path, work: Path) -> dict[str, str] | None:
    """What pip of ``python`` picks for '.[grpc,uvloop]' with constraints.txt, by
    normalized name (nothing is installed); None without such a Python here."""
    report = work / "report.json"
    interpreter = _interpreter(python)
    if interpreter is not None:
        target: list[str | Path] = [interpreter, "-m", "pip", "install"]
    elif python != "3.10" and sys.version_info >= (3, 11):
        target = [
            sys.executable, "-m", "pip", "install", "--only-binary=:all:", "--python-version",
            python, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
            "--target", work / "target",
        ]  # fmt: skip
    else:
        return None
    _run(
        *target, "--dry-run", "--quiet", "--ignore-installed", "--disable-pip-version-check",
        "--report", report, "-c", ROOT / "constraints.txt",
        f"appliance[grpc,uvloop] @ {wheel.as_uri()}",
        cwd=work,
    )  # fmt: skip
    return {
        normal(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }


@pytest.mark.parametrize("python", PYTHONS)
def test_the_deployment_constraints_resolve_on_every_supported_python(
    prepared: dict[str, Future], python: str
) -> None:
    """pip of that Python resolves '.[grpc,uvloop]' with constraints.txt (the file's
    environment markers are evaluated by the interpreter that resolves, so each Python
    resolves for itself; nothing is installed), and every package it picks is pinned
    there. Without that Python here, the running one resolves for it by wheel tags
    alone, where the markers read the same (3.11 and later)."""
    picked: dict[str, str] | None = prepared[python].result()
    if picked is None:
        pytest.skip(f"no Python {python} here to resolve its environment markers")
    assert picked.pop("appliance") == "0.1.0"
    wanted = pins(python)
    unpinned = {n: v for n, v in picked.items() if wanted.get(n) != v}
    assert not unpinned, f"picked but not pinned for Python {python}: {unpinned}"
    assert picked["onnxruntime"] == ("1.23.2" if python == "3.10" else "1.32.0")
