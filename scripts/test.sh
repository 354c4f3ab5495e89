#!/usr/bin/env bash
# Install what the tests need (the package with its `test` extra), then run every
# check: ruff, mypy and the whole pytest suite; then, each as its own step, what differs
# on Python 3.10 (JetPack 6's) where such an interpreter is present, the x86 container
# image where podman and its local base image are, and the install matrix (every
# documented install alone, in fresh venvs; in the background beside the last two, as
# the 3.10 venv's install is beside the main suite). Each step's time is printed as it
# ends and all of them once more at the end. This is the README's test command.
#
# Nothing is written into the checkout, so it may be read-only: the package is built
# from a copy in a temporary directory (setuptools would put egg-info and build/ next
# to the sources), and caches go to that directory too. Nothing is installed into the
# python3 on PATH either: the script makes a virtual environment of its own in that
# directory (pip refuses the system Python of Debian 12 and Ubuntu 24.04, PEP 668's
# EXTERNALLY-MANAGED) and puts it first on PATH, so every `python3` below is the venv's.
# The tests import the checkout itself (python3 -m puts the current directory first on
# sys.path); the install brings the dependencies and the `appliance` command.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
times=()
summary() {  # every step's time once more at the end, also when one failed
    local line
    if [ -n "${install310_pid:-}" ]; then  # a step failed beside the 3.10 install
        wait "$install310_pid" || true
    fi
    if [ -n "${matrix_pid:-}" ]; then  # a step failed beside the install matrix: its end
        wait "$matrix_pid" || true
        cat "$matrix_log"
    fi
    [ ${#times[@]} -eq 0 ] || echo "test.sh: step times (wall clock):"
    for line in "${times[@]}"; do echo "test.sh:   $line"; done
    echo "test.sh: $SECONDS s in all"
    rm -rf "$scratch"
}
trap summary EXIT
record() {  # name, start, exit status[, end]: the step's time, into the log and the summary
    local took=$(( ${4:-$SECONDS} - $2 ))
    echo "test.sh: $1 took $took s"
    if [ "$3" = 0 ]; then
        times+=("$1: $took s")
    else
        times+=("$1: $took s (failed, status $3)")
    fi
    return "$3"
}
step() {  # each step's wall time goes into the log (CI keeps it)
    local name=$1 started=$SECONDS status=0
    shift
    "$@" || status=$?
    record "$name" "$started" "$status"
}
background() {  # log, command...: run by a step in the background; it writes its own
    # exit status and end time beside its log, so that its time is the step's, not the
    # time until the script came round to collect it
    local log=$1 status=0
    shift
    "$@" >"$log" 2>&1 || status=$?
    echo "$status $SECONDS" >"$log.end"
}
collect() {  # pid, log, name, start time of a step run with background(): its end
    local status end
    wait "$1" || true
    cat "$2"
    read -r status end <"$2.end" || { status=1; end=$SECONDS; }
    record "$3" "$4" "$status" "$end"
}
# (not the quick start's .venv, nor anything a build left)
tar --exclude=.git --exclude=./.venv --exclude='*.egg-info' --exclude=build \
    --exclude=__pycache__ -cf - . | tar -xf - -C "$scratch"
constraints=()
[ -f constraints.txt ] && constraints=(-c constraints.txt)
# the MQTT tests run a real broker: Debian's mosquitto (installed to /usr/sbin, which a
# non-login PATH may lack; tests/mosquitto.py looks there too); tests/test_no_egress.py
# traces the server with strace in a sealed network namespace (unshare and mount come
# with util-linux); the OTA clock tests run the agent under Debian's libfaketime; and
# Debian ships venv's pip (ensurepip) apart from Python, in python3-venv
missing=()
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then missing+=(mosquitto); fi
if ! command -v strace >/dev/null; then missing+=(strace); fi
if ! compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null; then missing+=(faketime); fi
# the camera-stream tests serve RTSP with GStreamer's RTSP server (an H.264 test
# pattern: videotestsrc, x264enc, rtph264pay), run by Debian's python3 through python3-gi;
# docs/vision.md's Jetson pipeline is run with openh264dec in place of nvv4l2decoder
if command -v dpkg >/dev/null; then
    for pkg in python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base \
        gstreamer1.0-plugins-good gstreamer1.0-plugins-ugly gstreamer1.0-plugins-bad; do
        if ! dpkg -s "$pkg" >/dev/null 2>&1; then missing+=("$pkg"); fi
    done
fi
if ! python3 -c 'import ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "test.sh: ${missing[*]} not installed; the tests that need them will be skipped" >&2
    fi
fi
# a clean venv (no system site-packages); --no-compile: the tests compile what they
# import into PYTHONPYCACHEPREFIX anyway
venv() {
    python3 -m venv "$scratch/venv" \
        && "$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            --no-compile "${constraints[@]}" "$scratch[test]"
}
step "install (a venv of its own)" venv
export PATH="$scratch/venv/bin:$PATH" VIRTUAL_ENV="$scratch/venv"
hash -r
# bytecode is written, into that directory: an environment with PYTHONDONTWRITEBYTECODE
# (some CI images set it) would make every server, CLI and agent a test starts compile
# each module it imports from source again (the venvs are installed --no-compile)
export PYTHONPYCACHEPREFIX="$scratch/pycache"
unset PYTHONDONTWRITEBYTECODE
step "ruff" python3 -m ruff check --no-cache appliance devtools tests benchmarks
step "mypy" python3 -m mypy --cache-dir "$scratch/mypy"
# Python 3.10 (JetPack 6's): a fresh venv with the same constraints (their environment
# markers pick the 3.10 releases: numpy 2.2, Pillow 12, ONNX Runtime 1.23, which reads
# ONNX IR <= 11), then what differs between Pythons, not the whole suite again: every
# module imports and every dependency is at its pin (tests/test_every_python.py), config
# parsing, the README's blocks, servers started with HTTP, gRPC and MQTT inference,
# Python model namespaces, SIGTERM, and doctor against the installed engine (the README's
# quick start runs as written on 3.10 too; its OTA sequence, pure Python over the same
# fleet tools, only on the main Python: it costs half a minute). 3.11-only
# standard library calls are mypy's to catch (python_version = "3.10"). The deployment
# set with the OTA tools, pytest and onnx (no OpenVINO, linters or test-only extras):
# pyenv's 3.10, python3.10, or APPLIANCE_PYTHON310. Its venv is installed in the background
# beside the 2-worker step (their tests leave a core waiting on servers and subprocesses).
PY310_TESTS=(
    tests/test_every_python.py tests/config tests/test_readme.py tests/test_modelgen.py
    tests/test_datatypes.py tests/adapters/test_http_e2e.py tests/adapters/test_grpc_e2e.py
    tests/adapters/test_grpc_health.py tests/backends/test_python_imports.py
    tests/test_without_grpc.py
    tests/test_shutdown.py::test_grpc_call_in_flight_is_answered_and_stop_does_not_sit_out_the_timeout
    tests/adapters/test_mqtt.py::test_json_request_with_v5_response_topic
    tests/adapters/test_mqtt.py::test_binary_extension_request_and_reply
    tests/test_doctor.py::test_models_the_engine_would_refuse_are_named_as_serve_names_them
)
py310=""
for candidate in "${APPLIANCE_PYTHON310:-}" "$HOME"/.pyenv/versions/3.10*/bin/python3.10 \
        "$(command -v python3.10 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
        py310=$candidate
        break
    fi
done
if [ -z "$py310" ]; then
    echo "test.sh: no Python 3.10 found (pyenv's, python3.10, APPLIANCE_PYTHON310): not run on 3.10" >&2
fi

install310() {
    "$py310" -m venv "$scratch/py310"
    "$scratch/py310/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-compile "${constraints[@]}" "$scratch[grpc,uvloop,client,ota]" pytest onnx
}
install310_pid=""
if [ -n "$py310" ]; then
    install310_started=$SECONDS
    background "$scratch/install310.log" install310 &
    install310_pid=$!
fi

# the suite in two worker processes (pytest-xdist; CI has two cores), a test file per
# worker so that a module's shared server and fixtures stay in one process; then the
# tests marked serial (a network namespace, CPU time read) alone, nothing beside them
version=$(python3 -c 'import platform; print(platform.python_version())')
step "pytest ($version, 2 workers)" \
    python3 -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not serial"
if [ -n "$install310_pid" ]; then
    pid=$install310_pid
    install310_pid=""  # collected here, not again by the summary
    collect "$pid" "$scratch/install310.log" "install (3.10, beside the 2-worker step)" \
        "$install310_started"
fi
step "pytest ($version, serial)" python3 -m pytest -q -p no:cacheprovider -m serial

# every documented install on its own, each in a fresh venv (tests/test_install_matrix.py),
# in the background beside the steps that follow (the 3.10 suite is one process, podman
# mostly waits): its log and its time come after them
matrix_log="$scratch/install-matrix.log"
matrix_started=$SECONDS
background "$matrix_log" env APPLIANCE_INSTALL_MATRIX=1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_install_matrix.py &
matrix_pid=$!

if [ -n "$py310" ]; then
    step "pytest ($("$py310" -c 'import platform; print(platform.python_version())'))" \
        "$scratch/py310/bin/python" -m pytest -q -p no:cacheprovider "${PY310_TESTS[@]}" \
        --deselect tests/test_readme.py::test_shell_blocks_run_as_written
fi

# Dockerfile.x86 built and run with podman, where podman and the local Debian base
# image are (python3 -m devtools.container_check makes the base once: debootstrap takes
# minutes, so this script never does it, nor installs podman)
if command -v podman >/dev/null && [ "$(id -u)" = 0 ] \
    && podman image exists localhost/appliance-base:bookworm 2>/dev/null; then
    step "containers" env APPLIANCE_CONTAINER_CHECK=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_containers.py -k built_and_runs
else
    echo "test.sh: containers skipped: no podman, or no local base image (python3 -m devtools.container_check makes it)" >&2
fi

pid=$matrix_pid
matrix_pid=""  # collected here, not again by the summary
collect "$pid" "$matrix_log" "install matrix (beside the steps since the serial one)" \
    "$matrix_started"
