"""``appliance doctor``: what a field engineer needs to know about a device, at a glance.

Platform (Jetson model and L4T release, CPU architecture and features), installed
engines and ONNX Runtime's execution providers, GPU device nodes, memory against the
configured budget and the service's MemoryMax, whether the config is valid, what in
the model repository would fail to load and why (configs and files are checked, and
each model file is parsed by the engine that would serve it: IR version, opsets and
operators against the installed engine; no model is run), whether the ports are free
and the gRPC endpoint's libraries load, whether the MQTT broker and the update agent's
source (``ota.source``, or ``--ota-url``) answer (short timeouts; only what the config
or the command line names), and whether the clock is plausible (TLS and TUF metadata
expiry depend on it); and the device's telemetry now: temperatures, power, GPU load,
power mode and any throttling.

Each check is ``ok``, ``warn`` or ``fail``; the exit status is 1 when any check
fails, 0 otherwise; ``--json`` prints the same for scripts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from appliance.config.fields import physical_memory
from appliance.config.server_config import ServerConfig, load_server_config
from appliance.core.memory import fmt
from appliance.doctor_check import FAIL, OK, WARN, Check
from appliance.doctor_network import check_ota_config, check_ports, check_reachability
from appliance.errors import ApplianceError
from appliance.startup_report import SERVER_BASELINE
from appliance.telemetry import summary
from appliance.telemetry.device import Telemetry

# engines: import name -> distributions that may provide it (metadata, no import)
ENGINES = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "openvino": ("openvino",),
    "tensorrt": ("tensorrt", "tensorrt-cu12"),
    "pycuda": ("pycuda",),
    "grpc": ("grpcio",),
    "uvloop": ("uvloop",),
    "PIL": ("pillow",),
    "paho": ("paho-mqtt",),
}
BACKEND_ENGINE = {"onnxruntime": "onnxruntime", "openvino": "openvino", "tensorrt": "tensorrt"}
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "fma", "f16c", "asimd", "asimdhp", "sve")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").replace("\0", "").strip()
    except OSError:
        return ""


def l4t_release(text: str) -> str:
    """'# R36 (release), REVISION: 4.0, GCID: ...' -> 'R36.4.0' ('' when not L4T)."""
    head = text.splitlines()[0].lstrip("# ") if text.strip() else ""
    if not head.startswith("R"):
        return ""
    major = head.split()[0]
    revision = head.partition("REVISION:")[2].split(",")[0].strip()
    return f"{major}.{revision}" if revision else major


def check_platform() -> Check:
    cpuinfo = _read("/proc/cpuinfo")
    flags: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
        elif key.strip() == "model name" and not model:
            model = value.strip()
    details: dict[str, Any] = {
        "arch": platform.machine(),
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_features": [f for f in CPU_FEATURES if f in flags],
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            details["os"] = line.split("=", 1)[1].strip('"')
    jetson = _read("/proc/device-tree/model")
    if jetson:
        details["device_model"] = jetson
    release = l4t_release(_read("/etc/nv_tegra_release"))
    if release:
        details["l4t"] = release
    summary = f"{details['arch']}, {details.get('device_model') or model or 'unknown CPU'}"
    if "l4t" in details:
        summary += f", L4T {details['l4t']}"
    return Check("platform", OK, summary, details)


def _version(distributions: tuple[str, ...]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_engines() -> Check:
    versions = {
        name: _version(dists) for name, dists in ENGINES.items() if importlib.util.find_spec(name)
    }
    details: dict[str, Any] = {"installed": versions}
    if "onnxruntime" not in versions:
        return Check(
            "engines", FAIL, "onnxruntime is not installed: pip install appliance", details
        )
    try:
        import onnxruntime

        details["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except Exception as exc:  # a broken wheel (wrong arch, missing CUDA libs) says so here
        return Check("engines", FAIL, f"onnxruntime does not import: {exc}", details)
    summary = ", ".join(f"{k} {v}" for k, v in versions.items())
    return Check("engines", OK, summary, details)


def check_gpu() -> Check:
    nodes = [p for p in ("/dev/nvidia0", "/dev/nvhost-ctrl-gpu", "/dev/nvmap") if Path(p).exists()]
    nodes += [str(p) for p in sorted(Path("/dev/nvgpu").glob("*/ctrl"))]
    if not nodes:
        return Check("gpu", OK, "no NVIDIA GPU device nodes (CPU serving)", {"nodes": []})
    unreadable = [n for n in nodes if not os.access(n, os.R_OK | os.W_OK)]
    details = {"nodes": nodes, "not_accessible": unreadable}
    if unreadable:
        hint = "add the service user to the video and render groups (jetson-gpu.conf)"
        return Check("gpu", WARN, f"GPU nodes not accessible to this user: {hint}", details)
    return Check("gpu", OK, f"GPU device nodes: {', '.join(nodes)}", details)


def _cgroup_memory_max(unit: str = "appliance.service") -> int | None:
    text = _read(f"/sys/fs/cgroup/system.slice/{unit}/memory.max")
    return int(text) if text.isdigit() else None


def check_memory(config: ServerConfig | None) -> Check:
    total = physical_memory()
    available = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit = config.memory_limit if config else None
    cap = _cgroup_memory_max()
    details = {"total": total, "available": available, "memory_limit": limit, "memory_max": cap}
    summary = f"{fmt(total)} total, {fmt(available)} available, budget {fmt(limit)}"
    if limit is not None and limit > total:
        return Check("memory", FAIL, f"{summary}: memory_limit exceeds physical memory", details)
    if cap is not None:
        summary += f", service MemoryMax {fmt(cap)}"
        if limit is None or limit + SERVER_BASELINE > cap:
            why = "the kernel would kill the server before the budget refuses a model"
            return Check(
                "memory", WARN, f"{summary}: set memory_limit below MemoryMax - 128 MiB: {why}"
            )
    return Check("memory", OK, summary, details)


def check_repository(repository: Path) -> Check:
    """What would fail to load and why, from configs and files alone."""
    from appliance.backends.model_check import probe
    from appliance.backends.sealed import is_sealed
    from appliance.config.reader import load_model_config
    from appliance.core import repository as repo
    from appliance.core.loader import resolve_backend
    from appliance.core.warmup import lower_bound

    if not repository.is_dir():
        return Check("models", FAIL, f"model repository {repository} is not a directory")
    rows: dict[str, str] = {}
    failed = 0
    names = repo.model_names(repository)
    for name in names:
        try:
            config = load_model_config(repository / name)
            if config.platform == "ensemble":
                missing = sorted({s.model_name for s in config.ensemble_steps} - set(names))
                if missing:
                    raise ValueError(f"ensemble steps name models not in the repository: {missing}")
                rows[name] = f"ensemble of {len(config.ensemble_steps)} step(s)"
                continue
            versions = config.version_policy.select(repo.version_dirs(repository / name))
            if not versions:
                raise ValueError("no version folder (1/, 2/, ...)")
            backends = set()
            sealed: list[int] = []
            for v in versions:
                backend, path = resolve_backend(config, repository / name / str(v))
                engine = BACKEND_ENGINE.get(backend)
                if engine and importlib.util.find_spec(engine) is None:
                    hint = f"pip install 'appliance[{engine}]'"
                    raise ValueError(f"backend {backend} is not installed: {hint}")
                backends.add(backend)
                if is_sealed(path):  # encrypted at rest: only the server's key opens it
                    sealed.append(v)
                    continue
                problem = probe(backend, path)  # what the loader's engine would say
                if problem:
                    raise ValueError(f"version {v}: {problem}")
            rows[name] = f"{', '.join(sorted(backends))}, version(s) {versions}"
            if sealed:
                rows[name] += f"; sealed version(s) {sealed} not parsed (the server's key opens it)"
            lower = lower_bound(config)  # from the dims the config declares
            if lower:
                rows[name] += f"; memory is a lower bound: declare a model_warmup ({lower})"
        except (ApplianceError, ValueError) as exc:
            failed += 1
            rows[name] = f"WOULD FAIL: {exc}"
    details = {"repository": str(repository), "models": rows}
    if not names:
        return Check("models", WARN, f"{repository} has no models", details)
    summary = f"{len(names)} model(s) in {repository}, {failed} would fail to load"
    return Check("models", FAIL if failed else OK, summary, details)


def check_clock(reference: float | None = None) -> Check:
    """The clock is not behind the installed package's files and not absurdly ahead;
    NTP synchronisation is reported where systemd-timesyncd says so."""
    now = time.time()
    built = reference if reference is not None else Path(__file__).stat().st_mtime
    synced = Path("/run/systemd/timesync/synchronized").exists()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    details = {"now": stamp, "ntp_synced": synced}
    if now < built - 86400:
        when = time.strftime("%Y-%m-%d", time.gmtime(built))
        summary = f"the clock says {stamp}, before this software was installed ({when})"
        return Check("clock", FAIL, f"{summary}: TLS and signed updates will fail", details)
    if now > built + 20 * 365 * 86400:
        return Check("clock", WARN, f"the clock says {stamp}: implausibly late", details)
    return Check("clock", OK, stamp + (", NTP synchronised" if synced else ""), details)


def check_device(root: str = "/") -> Check:
    """Temperatures, power, GPU load, power mode and throttling, as the server exposes them."""
    telemetry = Telemetry.discover(root)
    try:
        status, line = summary.summary(telemetry.read(), telemetry.describe())
        return Check("device", status, line, {"sources": telemetry.describe()})
    finally:
        telemetry.close()


def run_checks(
    config_path: Path | None,
    ota_url: str | None,
    timeout: float,
    model_repository: Path | None = None,
) -> list[Check]:
    """Every check, on the server config at ``config_path`` (defaults without one) with
    ``model_repository`` in place of its repository when given, as ``serve`` takes it."""
    checks = [check_platform(), check_engines(), check_gpu(), check_device()]
    try:
        overrides = {"model_repository": model_repository}
        config: ServerConfig | None = load_server_config(config_path, overrides)
        checks.append(Check("config", OK, f"{config_path or 'defaults'}: valid"))
    except ApplianceError as exc:
        config = None
        checks.append(Check("config", FAIL, str(exc)))
    checks.append(check_memory(config))
    if config is not None:
        from appliance.server import demo_repository

        checks.append(check_repository(config.model_repository or demo_repository()))
        checks.append(check_ports(config))
        agent = check_ota_config(config_path)
        if agent is not None:
            checks.append(agent)
            ota_url = ota_url or agent.details.get("source")
        checks.append(check_reachability(config, ota_url, timeout))
    checks.append(check_clock())
    return checks


def main(args: argparse.Namespace) -> int:
    checks = run_checks(args.config, args.ota_url, args.timeout, args.model_repository)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2, default=str))
    else:
        for c in checks:
            print(f"[{c.status:4}] {c.name:9} {c.summary}")
            if c.name == "models":
                for name, row in c.details.get("models", {}).items():
                    print(f"{'':17}{name}: {row}")
    sys.stdout.flush()
    return 1 if any(c.status == FAIL for c in checks) else 0
