"""What differs between the supported Pythons, checked cheaply on each: every module
imports (syntax, and the standard library and dependency releases it needs at import),
the demo Python models compile, and the deployment constraints pinned every dependency
this interpreter installed. ``scripts/test.sh`` runs this file, with a few end-to-end
files, on Python 3.10 (JetPack 6's) as well as the main Python; 3.11-only standard
library calls inside functions are mypy's to catch (``python_version = "3.10"``).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("appliance", "devtools")
# engines that only some installs have: their backend modules import them at the top
# (the loader imports a backend module only when a model asks for that engine); and
# tools a devtools script is run with by hand, which no extra installs (atheris:
# devtools/fuzz_grpc.py)
OPTIONAL_ENGINES = {"openvino", "pycuda", "tensorrt", "atheris"}
# what constraints.txt is the lock of (its header: '.[grpc,uvloop,client]')
LOCKED = "appliance[grpc,uvloop,client]"

IMPORT_ALL = """
import importlib, json, pkgutil, sys
failed = {}
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if ".demo_models" in info.name or info.name.endswith(".__main__"):
            continue  # demo models are loaded from files; __main__ runs the CLI
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed[info.name] = [type(exc).__name__, exc.name or "", str(exc)]
print(json.dumps(failed))
"""


def test_every_module_imports_on_this_python() -> None:
    """Each module of the package, the backends, the OTA tools and devtools imports in a
    fresh interpreter; only a backend whose engine is not installed may fail, and only
    for that engine."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout.splitlines()[-1])
    unexpected = {
        name: why
        for name, why in failed.items()
        if not (why[0] == "ModuleNotFoundError" and why[1].split(".")[0] in OPTIONAL_ENGINES)
    }
    assert not unexpected, unexpected
    assert "appliance.backends.onnxruntime_backend" not in failed
    assert "appliance.ota.agent" not in failed


def test_the_demo_python_models_compile() -> None:
    models = sorted((ROOT / "appliance" / "demo_models").rglob("*.py"))
    assert models
    for path in models:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)


def pins(python: str | None = None) -> dict[str, str]:
    """constraints.txt's pins, by normalized name, whose environment markers hold on
    this interpreter, or on Python ``python`` (X.Y) on this platform."""
    environment = {} if python is None else {"python_version": python}
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            (spec,) = requirement.specifier
            found[normal(requirement.name)] = spec.version
    return found


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_deployment_constraints_pinned_what_this_python_installed() -> None:
    """Every distribution ``appliance[grpc,uvloop,client]`` needs on this interpreter
    is installed at the version constraints.txt pins for it (scripts/test.sh installs
    with the constraints: on Python 3.10 their environment markers pick the older
    releases, so the install there is the proof that they resolve)."""
    try:
        importlib.metadata.distribution("appliance")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is not installed here (scripts/test.sh installs it)")
    wanted = pins()
    seen: dict[str, str] = {}
    walked: set[tuple[str, frozenset[str]]] = set()  # tritonclient[grpc] and [http] both
    todo = [Requirement(LOCKED)]
    while todo:
        requirement = todo.pop()
        name = normal(requirement.name)
        if (name, frozenset(requirement.extras)) in walked:
            continue
        walked.add((name, frozenset(requirement.extras)))
        installed = importlib.metadata.distribution(requirement.name)
        seen[name] = installed.version
        for text in installed.requires or []:
            dependency = Requirement(text)
            asked = [{"extra": e} for e in requirement.extras] or [{"extra": ""}]
            if dependency.marker is None or any(dependency.marker.evaluate(a) for a in asked):
                todo.append(dependency)
    seen.pop("appliance")
    off = {n: (v, wanted.get(n)) for n, v in seen.items() if wanted.get(n) != v}
    assert not off, f"installed, but not at this Python's pin (installed, pin): {off}"
    assert {"numpy", "onnxruntime", "grpcio", "protobuf", "uvloop"} <= set(seen)


# what ONNX Runtime 1.23 (the last release for Python 3.10) requires but imports only in
# its model tools (onnxruntime.tools, onnxruntime.transformers): 53 MiB a 3.10 device
# may uninstall (the README's footprint)
ENGINE_TOOLS_ONLY = ("sympy", "mpmath", "coloredlogs", "humanfriendly")

SERVE_DEMO = """
import asyncio, json, sys
import numpy as np
from appliance import InProcessServer

async def main():
    async with InProcessServer(None) as server:  # the demo models, their warm-up too
        out = await server.infer("simple", {"INPUT0": np.ones((1, 16), np.int32),
                                            "INPUT1": np.ones((1, 16), np.int32)})
        assert int(out["OUTPUT0"].sum()) == 32
asyncio.run(main())
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1:])))
"""


def test_serving_never_imports_what_only_the_engines_tools_need() -> None:
    """The demo models loaded, warmed up and serving in a fresh interpreter: none of
    ONNX Runtime's tool-only dependencies is imported, so a device may remove them."""
    done = subprocess.run(
        [sys.executable, "-c", SERVE_DEMO, *ENGINE_TOOLS_ONLY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
