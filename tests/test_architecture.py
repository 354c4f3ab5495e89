"""The import graph keeps the layers of docs/architecture.md: no cycles (function-level
imports included: grimp reads every import statement), data flows down only, and
nothing below the protocol adapters imports a wire library."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("appliance", "devtools")

# highest first; a module may import its own layer and those below it, never above.
# A module is placed by the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    # entry points: the command line and its tools, the OTA agent, developer tools
    (
        "appliance.cli",
        "appliance.cli_parser",
        "appliance.cli_commands",
        "appliance.__main__",
        "appliance.doctor",
        "appliance.doctor_check",
        "appliance.doctor_network",
        "appliance.perf",
        "appliance.ota",
        "devtools",
    ),
    ("appliance",),  # the package itself: its lazy public names (InProcessServer...)
    # the process: composes adapters and core; the in-process API builds a Server too
    (
        "appliance.server",
        "appliance.sdnotify",
        "appliance.startup_report",
        "appliance.adapters.inprocess",
    ),
    # the wires, and the camera streams (decoders in, MQTT/webhook/file sinks out)
    ("appliance.adapters", "appliance.streams"),
    # images to model tensors and YOLO heads to boxes, over the data plane
    ("appliance.vision",),
    # the core, and beside it the device's telemetry readers (sysfs, NVML, jetson-stats)
    ("appliance.core", "appliance.telemetry"),
    ("appliance.backends",),
    ("appliance.config",),
    # the foundation every layer shares: errors, datatypes, names, the neutral request,
    # and what Python models import (pb_utils, BLS, decoupled responses)
    (
        "appliance.errors",
        "appliance.datatypes",
        "appliance.version",
        "appliance.names",
        "appliance.request",
        "appliance.decoupled",
        "appliance.bls",
        "appliance.python_model",
        "appliance.python_helpers",
        "appliance.process_env",
        "appliance.heap",
    ),
]
# wire and process libraries the core, config and backends must not reach
WIRE = (
    "aiohttp",
    "grpc",
    "grpc_health",
    "hpack",
    "paho",
    "tritonclient",
    "prometheus_client",
    "uvloop",
)
BELOW_ADAPTERS = (
    "appliance.vision",
    "appliance.core",
    "appliance.telemetry",
    "appliance.config",
    "appliance.errors",
    "appliance.datatypes",
    "appliance.version",
    "appliance.names",
    "appliance.request",
    "appliance.decoupled",
    "appliance.bls",
    "appliance.python_model",
    "appliance.python_helpers",
    "appliance.process_env",
    "appliance.backends",
)
# the wires: each its own package, sharing only what lies beside them in adapters/
# (the exchange, access, the KServe JSON codec), never importing one another
WIRES = ("appliance.adapters.http", "appliance.adapters.grpc", "appliance.adapters.mqtt")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    present = []
    for name in PACKAGES:
        try:
            __import__(name)
        except ImportError:
            continue
        present.append(name)
    return grimp.build_graph(*present, include_external_packages=True, cache_dir=None)


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            named = module == prefix or module.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _internal(graph: grimp.ImportGraph) -> list[str]:
    return sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)


def _cycles(graph: grimp.ImportGraph, modules: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    members = set(modules)
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        work = [(v, iter(sorted(graph.find_modules_directly_imported_by(v) & members)))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                grandchildren = graph.find_modules_directly_imported_by(child) & members
                work.append((child, iter(sorted(grandchildren))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in modules:
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph, _internal(graph)) == []


def test_every_module_has_a_layer(graph: grimp.ImportGraph) -> None:
    assert [m for m in _internal(graph) if _layer(m) is None] == []


def test_imports_flow_down_the_layers(graph: grimp.ImportGraph) -> None:
    upward = []
    for importer in _internal(graph):
        mine = _layer(importer)
        for imported in graph.find_modules_directly_imported_by(importer):
            theirs = _layer(imported)
            if mine is not None and theirs is not None and theirs < mine:
                # a package's __init__ may name its own submodules
                if imported.startswith(importer + "."):
                    continue
                upward.append(f"{importer} -> {imported}")
    assert upward == [], "imports that climb a layer: " + ", ".join(sorted(upward))


def test_nothing_below_the_adapters_imports_a_wire_library(graph: grimp.ImportGraph) -> None:
    found = []
    for importer in _internal(graph):
        if not importer.startswith(BELOW_ADAPTERS):
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            if any(imported == w or imported.startswith(w + ".") for w in WIRE):
                found.append(f"{importer} -> {imported}")
    assert found == [], "wire libraries below the adapters: " + ", ".join(sorted(found))


def test_no_wire_imports_another(graph: grimp.ImportGraph) -> None:
    crossing = []
    for importer in _internal(graph):
        mine = next((w for w in WIRES if importer.startswith(w + ".")), None)
        if mine is None:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            other = next((w for w in WIRES if imported == w or imported.startswith(w + ".")), None)
            if other is not None and other != mine:
                crossing.append(f"{importer} -> {imported}")
    assert crossing == [], "wires that import another wire: " + ", ".join(sorted(crossing))


def test_the_checks_can_fail(graph: grimp.ImportGraph) -> None:
    """The graph is real: the server imports the adapters, the adapters the core."""
    assert graph.direct_import_exists(
        importer="appliance.server", imported="appliance.adapters.http.api"
    )
    assert graph.find_modules_directly_imported_by("appliance.core.dataplane")
    # both wires that speak KServe JSON import its codec
    for wire in ("appliance.adapters.http.infer", "appliance.adapters.mqtt.codec"):
        assert graph.direct_import_exists(importer=wire, imported="appliance.adapters.codec.kserve")
