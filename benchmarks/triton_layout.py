"""The real NVIDIA Triton Inference Server and perf_analyzer, laid out from their PyPI
wheels for ``bench_triton.py``; next to the scripts, like ``machine.py``.

Triton: release 2.51 is the ``tritonserver`` binary inside the ``nvidia-pytriton``
0.7.0 wheel, with its libraries (``nvidia_pytriton.libs``), the Python backend and a
Python backend stub per Python version. The wheel carries no ONNX Runtime backend, so
an ONNX model runs there as a Python-backend model calling ONNX Runtime in-process
(:func:`python_model`), unless the user brings Triton's native ONNX Runtime backend,
built from its sources (:func:`native_backends`). It serves on the CPU (it logs that
there is no CUDA driver).

perf_analyzer: the ``perf-analyzer`` wheel. Its binary needs glibc 2.38; on an older
system (Debian 12 has 2.36) it runs through Debian 13's loader and C/C++ runtime,
fetched once with ``apt-get download`` into the cache (nothing system-wide changes).

Everything is cached under ``$APPLIANCE_BENCH_CACHE`` (default
``~/.cache/appliance-bench``).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
PERF_ANALYZER = "perf-analyzer==2.60.0"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "appliance-bench"
    path = Path(os.environ.get("APPLIANCE_BENCH_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download(spec: str, into: Path, platform_tag: str | None = None) -> Path:
    """The wheel of ``spec`` (pip download, no dependencies), extracted into ``into``."""
    marker = into / ".extracted"
    if marker.exists():
        return into
    wheels = into.with_suffix(".wheels")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    if platform_tag:
        cmd += ["--platform", platform_tag, "--python-version", "3.11"]
    subprocess.run([*cmd, "-d", str(wheels), spec], check=True)
    name = spec.split("==")[0].replace("-", "_")
    (wheel,) = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(name)]
    into.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into)
    marker.touch()
    return into


class Triton:
    """The tritonserver binary, ready to run with the running Python's backend stub."""

    def __init__(self) -> None:
        root = _download(PYTRITON, cache_dir() / "pytriton")
        dist = root / "pytriton" / "tritonserver"
        self.binary = dist / "bin" / "tritonserver"
        self.binary.chmod(0o755)
        self.backends = dist / "backends"
        self.libs = root / "nvidia_pytriton.libs"
        # a backend built from Triton's sources links ``libtritonserver.so``, which the
        # wheel ships renamed (``libtritonserver-<hash>.so``): a link under that name,
        # on the library path of a server with a native backend
        self.core = root / "core"
        link = self.core / "libtritonserver.so"
        if not link.exists():
            (core,) = self.libs.glob("libtritonserver-*.so")
            self.core.mkdir(exist_ok=True)
            link.symlink_to(core)
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise SystemExit(f"the {PYTRITON} wheel has no Python backend stub for {version}")
        target = self.backends / "python" / "triton_python_backend_stub"
        if not target.exists():
            shutil.copy(stub, target)
            target.chmod(0o755)

    def command(
        self, repository: Path, http: int, grpc: int, metrics: int, backends: Path | None = None
    ) -> list[str]:
        """``backends``: a backend directory of the user's (:func:`native_backends`);
        default the wheel's, which has the Python backend only."""
        return [
            str(self.binary),
            f"--model-repository={repository}",
            f"--backend-directory={backends or self.backends}",
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            "--allow-metrics=false",
            "--log-verbose=0",
            "--exit-timeout-secs=5",
        ]

    def env(self, backends: Path | None = None) -> dict[str, str]:
        """The running Python's libpython for the stub, and its packages (numpy, ONNX
        Runtime) on the stub's path: the Python models run the same ONNX Runtime.
        ``backends``: a native backend directory, whose ``onnxruntime`` folder (the
        backend and the ``libonnxruntime.so`` it was built with) joins the library path."""
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        own = [str(backends / "onnxruntime"), str(self.core)] if backends else []
        paths = [*own, str(self.libs), libdir, os.environ.get("LD_LIBRARY_PATH", "")]
        site = [p for p in sys.path if p.endswith("site-packages")]
        return {
            **os.environ,
            "LD_LIBRARY_PATH": ":".join(p for p in paths if p),
            "PYTHONPATH": ":".join(site),
        }


def native_backends(folder: Path | None) -> Path | None:
    """A backend directory holding Triton's native ONNX Runtime backend, which the
    user built from Triton's public onnxruntime_backend sources (this project neither
    ships nor builds it); None when not given. Exits naming what is missing."""
    if folder is None:
        return None
    folder = folder.resolve()
    library = folder / "onnxruntime" / "libtriton_onnxruntime.so"
    if not library.is_file():
        raise SystemExit(
            f"--triton-backend-dir {folder}: no {library.relative_to(folder)} in it (build "
            "Triton's onnxruntime_backend at the branch of Triton 2.51, r24.10, and point "
            "here at its install folder's appliance/backends/)"
        )
    return folder


PYTHON_MODEL = '''\
"""A Triton Python-backend model that runs {onnx} with ONNX Runtime in-process, with
the same session options as the appliance's ONNX Runtime backend."""
import json
from pathlib import Path

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        so = ort.SessionOptions()
        so.intra_op_num_threads = {threads}
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        path = Path(args["model_repository"]) / args["model_version"] / "{onnx}"
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]

    def execute(self, requests):
        # one session run per batch, as the appliance's dynamic batcher does
        import numpy as np

        parts = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs]
                 for r in requests]
        feed = {{n: np.concatenate([p[i] for p in parts]) for i, n in enumerate(self.inputs)}}
        results = self.session.run(self.outputs, feed)
        responses, row = [], 0
        for p in parts:
            rows = p[0].shape[0]
            tensors = [pb_utils.Tensor(n, r[row:row + rows]) for n, r in zip(self.outputs, results)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            row += rows
        return responses
'''


def python_model(onnx_name: str, threads: int) -> str:
    return PYTHON_MODEL.format(onnx=onnx_name, threads=threads)


def _glibc() -> tuple[int, int]:
    version = platform.libc_ver()[1] or "0.0"
    major, minor = (int(x) for x in version.split(".")[:2])
    return major, minor


def perf_analyzer() -> list[str]:
    """A command line that runs perf_analyzer from the ``perf-analyzer`` wheel."""
    arch = platform.machine()
    root = _download(PERF_ANALYZER, cache_dir() / "perf-analyzer", f"manylinux_2_38_{arch}")
    binary = root / "perf_analyzer" / "bin" / "perf_analyzer"
    binary.chmod(0o755)
    if _glibc() >= (2, 38):
        return [str(binary)]
    sysroot = cache_dir() / "trixie-runtime"
    lib = sysroot / "usr" / "lib" / f"{arch}-linux-gnu"
    loader = next(iter(lib.glob("ld-linux*.so.*")), None)
    if loader is None:
        _debian_runtime(sysroot)
        loader = next(iter(lib.glob("ld-linux*.so.*")))
    system = f"/lib/{arch}-linux-gnu:/usr/lib/{arch}-linux-gnu"
    return [str(loader), "--library-path", f"{lib}:{system}", str(binary)]


def _debian_runtime(sysroot: Path) -> None:
    """Debian 13's libc6, libstdc++6 and libgcc-s1, unpacked into ``sysroot`` (the
    machine's own Debian mirror, trixie suite; apt's state stays in the cache)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    uri = next(
        (ln.split()[1] for ln in sources.read_text().splitlines() if ln.startswith("URIs:")), None
    )
    if uri is None:
        raise SystemExit("perf_analyzer needs glibc 2.38: pass --perf-analyzer PATH")
    apt = sysroot.with_suffix(".apt")
    for sub in ("lists/partial", "cache/archives/partial", "etc"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "etc" / "trixie.sources").write_text(
        f"Types: deb\nURIs: {uri}\nSuites: trixie\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    opts = [
        "-o", "Dir::Etc::sourcelist=-",
        "-o", f"Dir::Etc::sourceparts={apt / 'etc'}",
        "-o", f"Dir::State::Lists={apt / 'lists'}",
        "-o", f"Dir::Cache={apt / 'cache'}",
        "-o", "Dir::State::status=/dev/null",
    ]  # fmt: skip
    subprocess.run(["apt-get", *opts, "-qq", "update"], check=True)
    subprocess.run(
        ["apt-get", *opts, "-qq", "download", "libc6", "libstdc++6", "libgcc-s1"],
        check=True,
        cwd=apt,
    )
    for deb in apt.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(sysroot)], check=True)
