"""Build ``Dockerfile.x86`` with podman and run the image as a device would.

    python3 -m devtools.container_check [--base IMAGE] [--json] [--out FILE]

Needs root, Debian's podman and runc (``apt-get install podman runc``) and, to make the
base image the first time, debootstrap. Each step is timed:

1. podman runs with a private containers.conf (``CONTAINERS_CONF``): the runc runtime,
   and ``default_ulimits = []`` (machines that refuse raising rlimits refuse podman's
   default ones);
2. the base: ``--base``, or ``localhost/appliance-base:bookworm``, made once (and kept
   in podman's store) from a debootstrapped Debian bookworm with its python3 and
   python3-venv, ``podman import``-ed: no registry is needed;
3. the wheels the build installs, downloaded here with pip (constraints.txt; kept in
   ``~/.cache/appliance/container-wheels`` for the next run with the same pins) into
   the build context's ``wheels/``: the build itself runs without a network
   (``--network none``, ``PIP_NO_INDEX=1``);
4. ``podman build --format docker`` (the Docker format keeps ``HEALTHCHECK``);
5. the container runs with the demo models mounted read-only at ``/models`` and port
   8000 published on a free loopback port, and must: serve the demo models (an
   inference on ``simple``, every model READY), pass its HEALTHCHECK (``podman
   healthcheck run``), run as its non-root user (the server process's uids, read from
   the host's /proc, are 10001), and stop cleanly on SIGTERM (``podman stop``: exit
   status 0 and the server's "stopped" line, no SIGKILL);
6. the image's size.

Prints the figures (``--json``: as JSON); ``--out`` writes them as a markdown record
for benchmarks/results/. ``tests/test_containers.py`` runs this where podman is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE = "localhost/appliance-base:bookworm"
IMAGE = "localhost/appliance:x86-check"
CONTEXT_FILES = ("pyproject.toml", "README.md", "LICENSE", "constraints.txt", "Dockerfile.x86")
CONTEXT_DIRS = ("appliance", "wheels")
CONF = '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n'


class CheckFailed(RuntimeError):
    pass


class Podman:
    def __init__(self, scratch: Path) -> None:
        if shutil.which("podman") is None:
            raise CheckFailed("podman is not installed: apt-get install podman runc")
        conf = scratch / "containers.conf"
        conf.write_text(CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        done = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise CheckFailed(f"podman {' '.join(args[:2])} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def logs(self, name: str) -> str:
        """The container's output (podman logs writes its stderr to stderr)."""
        done = subprocess.run(
            ["podman", "logs", name], env=self.env, capture_output=True, text=True, timeout=60
        )
        return done.stdout + done.stderr


def make_base(podman: Podman, scratch: Path) -> None:
    """A Debian bookworm root with python3 and its venv module, imported as BASE."""
    if shutil.which("debootstrap") is None:
        raise CheckFailed("debootstrap is not installed: apt-get install debootstrap")
    root = scratch / "rootfs"
    subprocess.run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
         str(root), "http://deb.debian.org/debian"],
        check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["podman", "import", "-", BASE], stdin=tar.stdout, env=podman.env, capture_output=True
    )
    tar.wait()
    if imported.returncode != 0:
        raise CheckFailed(f"podman import failed: {imported.stderr.decode()[-2000:]}")


def make_context(podman: Podman, base: str, scratch: Path) -> Path:
    """The build context: the sources the Dockerfile copies, and the wheels it installs
    (for the base's Python, which must be this one's minor version)."""
    context = scratch / "context"
    context.mkdir()
    for name in CONTEXT_FILES:
        shutil.copy2(ROOT / name, context / name)
    for name in CONTEXT_DIRS:
        shutil.copytree(ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__"))
    version = "import sys; print('.'.join(map(str, sys.version_info[:2])))"
    theirs = podman("run", "--rm", "--network", "none", base, "python3", "-c", version).strip()
    ours = ".".join(map(str, sys.version_info[:2]))
    if theirs != ours:
        raise CheckFailed(f"the base has Python {theirs}: run this with that Python, not {ours}")
    wheels = context / "wheels"
    cache = _wheel_cache(ours)
    if not cache.is_dir():
        _download_wheels(context, scratch, cache)
    for wheel in cache.iterdir():
        shutil.copy2(wheel, wheels / wheel.name)
    return context


def _wheel_cache(python: str) -> Path:
    """Where the wheels for these pins are kept between runs (outside the checkout):
    one folder per constraints.txt, pyproject.toml and Python."""
    digest = hashlib.sha256(python.encode())
    for name in ("constraints.txt", "pyproject.toml"):
        digest.update((ROOT / name).read_bytes())
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "appliance" / "container-wheels" / digest.hexdigest()[:16]


def _download_wheels(context: Path, scratch: Path, cache: Path) -> None:
    """Every wheel '.[grpc,uvloop]' needs (constraints.txt), and setuptools to build it."""
    source = scratch / "source"  # pip writes egg-info next to the sources it builds
    shutil.copytree(context, source, ignore=shutil.ignore_patterns("wheels"))
    partial = cache.with_name(cache.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    wanted = (["-c", str(ROOT / "constraints.txt"), f"{source}[grpc,uvloop]"], ["setuptools>=77"])
    for what in wanted:
        subprocess.run(
            [*pip, "-d", str(partial), *what], check=True, capture_output=True, timeout=900
        )
    for built in partial.glob("appliance-*"):
        built.unlink()  # the build installs the package from its sources
    partial.rename(cache)  # complete, or not there


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def infer_simple(port: int, model: str = "simple") -> list[int]:
    """OUTPUT0 of Triton's "simple" model (INPUT0 + INPUT1) for two copies of 0..15, over
    HTTP JSON with the standard library only (what a bare install or image has)."""
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
            for n in ("INPUT0", "INPUT1")
        ]
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        doc = json.loads(reply.read())
    return [int(x) for x in next(o for o in doc["outputs"] if o["name"] == "OUTPUT0")["data"]]


def _post(port: int, path: str) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"{}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def run_image(podman: Podman, scratch: Path) -> dict[str, Any]:
    """Run the image with the demo models; what was seen (raises CheckFailed)."""
    models = scratch / "models"
    shutil.copytree(ROOT / "appliance" / "demo_models", models,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    port, name = _free_port(), f"appliance-check-{os.getpid()}"
    podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
           "-v", f"{models}:/models:ro", IMAGE)  # fmt: skip
    seen: dict[str, Any] = {}

    def healthy() -> bool:
        done = subprocess.run(["podman", "healthcheck", "run", name], env=podman.env,
                              capture_output=True, timeout=60)  # fmt: skip
        return done.returncode == 0

    try:
        started = time.monotonic()
        while not healthy():
            if time.monotonic() - started > 180:
                logs = podman.logs(name)
                raise CheckFailed(f"the HEALTHCHECK never passed:\n{logs}")
            time.sleep(1)
        seen["healthy_after_s"] = round(time.monotonic() - started, 1)
        seen["inference"] = infer_simple(port)
        index = _post(port, "/v2/repository/index")
        seen["ready"] = sorted(m["name"] for m in index if m.get("state") == "READY")
        # the server's own process, as the host sees it (the image has no ps for podman top)
        pid = int(podman("inspect", name, "--format", "{{.State.Pid}}"))
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        seen["process_uids"] = next(line for line in status if line.startswith("Uid:")).split()[1:]
        seen["process"] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        seen["config_user"] = podman("inspect", name, "--format", "{{.Config.User}}").strip()
        stopping = time.monotonic()
        podman("stop", "--time", "60", name, timeout=120)
        seen["stop_s"] = round(time.monotonic() - stopping, 1)
        seen["exit_code"] = int(podman("inspect", name, "--format", "{{.State.ExitCode}}"))
        seen["log_tail"] = podman.logs(name).strip().splitlines()[-2:]
    finally:
        podman("rm", "-f", name, check=False)
    return seen


def check(base: str | None, no_cache: bool = False) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    with tempfile.TemporaryDirectory(prefix="appliance-container-") as tmp:
        scratch = Path(tmp)
        podman = Podman(scratch)
        figures["podman"] = podman("--version").strip()
        t = time.monotonic()
        if base is None:
            base = BASE
            if subprocess.run(["podman", "image", "exists", BASE], env=podman.env).returncode:
                make_base(podman, scratch)
                figures["base_made_s"] = round(time.monotonic() - t, 1)
        figures["base"] = base
        t = time.monotonic()
        context = make_context(podman, base, scratch)
        figures["wheels_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        podman("build", *(["--no-cache"] if no_cache else []), "--format", "docker",
               "--network", "none", "--build-arg",
               f"PYTHON_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1", "--build-arg",
               "PIP_FIND_LINKS=/tmp/wheels", "-f", "Dockerfile.x86", "-t", IMAGE, str(context),
               timeout=1800)  # fmt: skip
        figures["build_s"] = round(time.monotonic() - t, 1)
        figures["image_bytes"] = int(podman("image", "inspect", IMAGE, "--format", "{{.Size}}"))
        figures["base_bytes"] = int(podman("image", "inspect", base, "--format", "{{.Size}}"))
        try:
            figures.update(run_image(podman, scratch))
        finally:  # the previous run's images and this build's stage: disk, not cache
            podman("image", "prune", "--force", check=False)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help=f"base image with python3 (default: {BASE}, made here)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--no-cache", action="store_true", help="build every layer again")
    parser.add_argument("--out", type=Path, help="write the figures as a markdown record")
    args = parser.parse_args()
    load = os.getloadavg()
    try:
        figures = check(args.base, args.no_cache)
    except (CheckFailed, subprocess.SubprocessError) as exc:
        print(f"container check: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            print(f"{key}: {value}")
    if args.out:
        rows = [f"| {key} | {value} |" for key, value in figures.items()]
        lines = [
            f"# Dockerfile.x86 built and run with podman, {time.strftime('%Y-%m-%d')}",
            "",
            f"`python3 -m devtools.container_check {' '.join(sys.argv[1:])}`; load average "
            f"{load[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min).",
            "",
            "| figure | value |",
            "|---|---|",
            *rows,
        ]
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
