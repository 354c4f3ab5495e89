"""Every fenced block in README.md is run or checked, as its marker says.

Each block is preceded by ``<!-- readme-test: KIND (how) -->``; a block without a
marker fails the test, so a snippet cannot be added unchecked. Kinds:

- ``server``: the quick-start line, run as written in a copy of the checkout (a fresh
  clone's files) with ``python3`` on PATH a Python that refuses ``pip install`` as
  Debian 12's and Ubuntu 24.04's do (PEP 668's ``EXTERNALLY-MANAGED``; see
  ``managed_python``): every command before the last runs as written, the last one (the
  server) on free loopback ports, and it must exit 0 on SIGTERM.
- ``client``: Python run in a subprocess against that server (its HTTP port put in for
  8000), in a temporary folder holding a generated ``cat.jpg``.
- ``python``: Python run as written in a subprocess, no server.
- ``server config``: YAML loaded with ``load_server_config`` next to a ``models`` folder.
- ``synopsis``: every ``--flag`` in it must be one ``appliance serve --help`` lists.
- ``checked``: ``./scripts/test.sh``, which runs this suite: it must exist and be
  executable, and is not run from inside itself.
- ``shell``: a sequence run as written with ``bash -e`` in the quick start's folder
  (its ``.venv`` made), a real mosquitto started for it, free ports put in for the
  ports it names (see ``test_shell_blocks_run_as_written``).
- ``commands``: ``appliance`` command lines; each is parsed by the real command line
  (every subcommand and flag must exist, as for the ``appliance`` lines of ``shell``
  blocks); the tests of that command run them.
- ``text``: diagrams and layouts, not code.
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
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mosquitto import Broker, free_port, require_mosquitto

from appliance.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MARKED = re.compile(r"<!-- readme-test: ([a-z ]+?)(?: \(.*?\))? -->\n```(\w*)\n(.*?)```", re.S)
KINDS = {
    "server",
    "client",
    "python",
    "server config",
    "synopsis",
    "checked",
    "commands",
    "shell",
    "text",
}
BLOCKS = [(m.group(1), m.group(2), m.group(3)) for m in MARKED.finditer(README)]


def _blocks(kind: str) -> list[str]:
    return [body for k, _, body in BLOCKS if k == kind]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout, as the suite tests it


def test_every_block_is_marked_with_a_known_kind() -> None:
    fences = re.findall(r"^```", README, re.M)
    assert len(fences) == 2 * len(BLOCKS), "a fenced block lacks its readme-test marker"
    assert {kind for kind, _, _ in BLOCKS} <= KINDS


def managed_python(folder: Path) -> Path:
    """A Python that carries PEP 668's ``EXTERNALLY-MANAGED`` marker, as Debian's does.

    pip looks for the marker in the interpreter's stdlib folder and ignores it inside a
    venv, so a venv cannot carry it: this is a stand-in installation instead. The base
    interpreter's binary is copied to ``folder/bin/python3``; ``folder/lib/pythonX.Y``
    holds links to every entry of its standard library, the marker, and pip (so that the
    refusal can be shown). Python finds its prefix from the binary's place (the
    ``os.py`` landmark), so ``folder`` is this installation's prefix and stdlib."""
    real = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix})["stdlib"])
    (folder / "bin").mkdir(parents=True)
    shutil.copy2(real, folder / "bin" / "python3")
    lib = folder / "lib" / stdlib.name
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED"):
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=managed by the system (tests/test_readme.py)\n",
        encoding="utf-8",
    )
    (lib / "site-packages").mkdir()
    import pip

    (lib / "site-packages" / "pip").symlink_to(Path(pip.__file__).parent)
    return folder / "bin"


def _clone(into: Path) -> Path:
    """The checkout's files as a fresh clone has them (no builds, caches or venvs)."""
    skip = shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".venv", ".*_cache", "dist", "out"
    )
    shutil.copytree(ROOT, into, ignore=skip, symlinks=True)
    return into


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A copy of the checkout after the quick start's commands before the server ran
    there as written, under a PEP 668 Python; its environment (that Python first on
    PATH, nothing of this checkout or venv)."""
    (command,) = _blocks("server")
    *setup, _ = (part.strip() for part in command.strip().split("&&"))
    base = tmp_path_factory.mktemp("managed")
    folder = _clone(base / "clone")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        [str(managed_python(base / "python"))]
        + [p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)]
    )
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    refused = subprocess.run(
        ["python3", "-m", "pip", "install", "."],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # the stand-in refuses as Debian's Python does
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr
    for part in setup:
        done = subprocess.run(
            part, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{part}: {done.stdout}\n{done.stderr}"
    return folder, env


@pytest.fixture(scope="module")
def quick_start(clone: tuple[Path, dict[str, str]]) -> Iterator[int]:
    """The quick-start server, as written, on free ports."""
    folder, env = clone
    (command,) = _blocks("server")
    serve = command.strip().split("&&")[-1].strip()
    argv = shlex.split(serve)
    assert argv[:2] == [".venv/bin/appliance", "serve"], serve
    port = free_port()
    ports = ["--http-port", str(port), "--grpc-port", "-1", "--metrics-port", str(free_port())]
    proc = subprocess.Popen(
        [str(folder / argv[0]), *argv[1:], *ports],
        cwd=folder,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the quick-start server never became ready"
                time.sleep(0.1)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err  # "exits 0"
    assert "ready in" in err
    assert "WARNING" not in err, err  # a first run is clean


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("index", range(len(_blocks("client"))))
def test_client_snippets_run_against_the_quick_start_server(
    quick_start: int, index: int, tmp_path: Path
) -> None:
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 120, 40)).save(tmp_path / "cat.jpg")
    code = _blocks("client")[index].replace("127.0.0.1:8000", f"127.0.0.1:{quick_start}")
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    if '"simple"' in code:  # the first snippet prints a + 1
        numbers = [int(x) for x in re.findall(r"-?\d+", done.stdout)]
        assert numbers == list(range(1, 17))


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_snippets_run_as_written(index: int, tmp_path: Path) -> None:
    done = _python(_blocks("python")[index], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "WARNING" not in done.stderr, done.stderr  # the demo models load cleanly


SHELL_PORTS = ("1883", "8080", "8100", "8102")  # a broker's, a file server's, a device's


@pytest.mark.parametrize("index", range(len(_blocks("shell"))))
def test_shell_blocks_run_as_written(
    clone: tuple[Path, dict[str, str]], index: int, tmp_path: Path
) -> None:
    """In the quick start's folder, with bash -e (a failing line fails it), a real
    mosquitto for the broker the block names, free ports put in for its ports. What is
    left running at the end (the block's own background jobs, on a failure) is ended
    by its process group."""
    folder, env = clone
    broker = Broker(require_mosquitto(), tmp_path)
    broker.start()
    ports = {"1883": str(broker.port), **{p: str(free_port()) for p in SHELL_PORTS[1:]}}
    script = re.sub(
        rf"\b({'|'.join(SHELL_PORTS)})\b", lambda m: ports[m[1]], _blocks("shell")[index]
    )
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=folder,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        broker.stop()
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "Traceback" not in err, err
    if "ota status" in script:  # the device installed the published version
        decoder = json.JSONDecoder()
        printed = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r"^\{", out, re.M)]
        (status,) = [doc for doc in printed if "models" in doc]  # what `ota status` printed
        assert status["models"]["simple"]["current"] == 1, out
        assert "simple v1: pending 0 updated 1 failed 0" in out  # fleet watch saw the report


@pytest.mark.parametrize("index", range(len(_blocks("server config"))))
def test_server_config_snippets_load(index: int, tmp_path: Path) -> None:
    from appliance.config.server_config import load_server_config

    (tmp_path / "models").mkdir()
    path = tmp_path / "appliance.yaml"
    path.write_text(_blocks("server config")[index], encoding="utf-8")
    load_server_config(path, {})


def test_the_synopsis_lists_real_flags() -> None:
    (synopsis,) = _blocks("synopsis")
    helptext = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    flags = set(re.findall(r"--[a-z][a-z-]+", synopsis))
    assert flags and all(flag in helptext for flag in flags), flags


def test_the_test_command_exists() -> None:
    (command,) = _blocks("checked")
    script = ROOT / command.strip()
    assert script.is_file() and os.access(script, os.X_OK)


def test_command_lines_parse() -> None:
    """Every ``appliance`` line of the ``commands`` and ``shell`` blocks is parsed by
    the real command line (every subcommand and flag must exist)."""
    lines = [
        line.split("#")[0].split(" 2>")[0].rstrip(" &")
        for kind in ("commands", "shell")
        for block in _blocks(kind)
        for line in block.splitlines()
        if line.startswith("appliance ")
    ]
    assert lines
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line)
        try:
            parser.parse_args(argv[1:])
        except SystemExit as exc:  # argparse's way of refusing
            raise AssertionError(f"the command line refuses {line!r}") from exc


def test_the_quoted_config_error_is_what_the_validator_says() -> None:
    import yaml

    from appliance.config.fields import ConfigError
    from appliance.config.model_config import parse_model_config

    found = re.search(r"`dims: (\[[^`]*\])` in `([^`]+)` gets\s+`([^`]+)`", README)
    assert found, "the README's example of a config error"
    dims, source, quoted = found.groups()
    doc = yaml.safe_load(f"input: [{{name: a, data_type: TYPE_FP32, dims: {dims}}}]")
    with pytest.raises(ConfigError) as error:
        parse_model_config(doc, "det", source)
    assert str(error.value) == quoted


def test_the_layout_names_every_module_of_the_package() -> None:
    """Each module of appliance/ and its subpackages, at any depth, appears in the README's Layout
    (``sequence_*`` stands for every module with that prefix)."""
    layout = README[README.index("## Layout") :]
    layout = layout[: layout.index("\n## ", 1)] if "\n## " in layout[1:] else layout
    words = set(re.findall(r"[a-z_0-9]+\*?", layout))
    prefixes = tuple(w[:-1] for w in words if w.endswith("*"))
    package = ROOT / "appliance"
    modules = [
        p.stem
        for p in package.rglob("*.py")
        if p.stem not in ("__init__", "__main__") and (p.parent / "__init__.py").exists()
    ]
    missing = sorted(m for m in modules if m not in words and not m.startswith(prefixes))
    assert not missing, f"the README's Layout leaves out {missing}"
