#!/usr/bin/env bash
# Prove the CPU path on arm64 (Jetson, most edge boards) on an x86 machine: an arm64
# Debian bookworm chroot run through qemu-user emulation, the package installed from
# aarch64 wheels, and the core end-to-end tests run inside it (serving the demo and
# generated models, tritonclient inference, dynamic batching, hot swap).
#
#   sudo scripts/arm64-check.sh [WORK_DIR]        # default: /var/tmp/appliance-arm64
#
# Needs debootstrap, qemu-user-static (its aarch64 binfmt handler is registered here
# when the host has none) and the Debian archive and package index reachable.
#
# ONNX Runtime: onnxruntime 1.32 crashes under bookworm's qemu-user 7.2 (trixie's qemu
# 10 runs it); 1.19.2 with numpy 1.26 runs under 7.2, so this check pins those. Real
# arm64 hardware runs the versions constraints.txt pins. Timing figures under emulation say
# nothing about a device; the script reports what ran and how long it took.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/var/tmp/appliance-arm64}
R=$WORK/rootfs
TESTS=(
    tests/adapters/test_http_e2e.py
    tests/core/test_batching_e2e.py
    tests/core/test_hot_swap.py
    tests/adapters/test_inprocess.py
    tests/adapters/test_grpc_e2e.py
    tests/core/test_ensemble.py
    tests/test_cli.py
    tests/test_readme.py
)
started=$(date +%s)

# aarch64 executables run through qemu: register the handler (F: the interpreter is
# opened now, so it works inside the chroot without a copy there)
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qemu-aarch64:M::$magic:$mask:/usr/bin/qemu-aarch64-static:F" \
        > /proc/sys/fs/binfmt_misc/register
fi

if [ ! -x "$R/usr/bin/python3" ]; then
    mkdir -p "$WORK"
    debootstrap --variant=minbase --arch=arm64 --include=python3,python3-venv,mosquitto \
        bookworm "$R"
fi
echo "arm64-check: chroot ready after $(( $(date +%s) - started )) s ($(chroot "$R" uname -m))"

# aarch64 wheels for Python 3.11 (bookworm's), fetched on the host with its pip settings
wheels=$WORK/wheels
rm -rf "$wheels" "$R/src"
mkdir -p "$wheels" "$R/src"
tar -C "$ROOT" --exclude=.git --exclude=images/out --exclude='*.egg-info' --exclude=build \
    --exclude=__pycache__ -cf - . | tar -xf - -C "$R/src"
cat > "$WORK/arm64-pins.txt" <<'EOF'
onnxruntime==1.19.2
numpy==1.26.4
EOF
python3 -m pip download --quiet --disable-pip-version-check -d "$wheels" \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp \
    --only-binary=:all: -c "$WORK/arm64-pins.txt" \
    "numpy>=1.23" "onnxruntime>=1.16" "aiohttp>=3.9" "orjson>=3.8" "pyyaml>=6.0" \
    "tritonclient[http]>=2.62,<2.70" "protobuf>=5.26.1,<8" "paho-mqtt>=2.0" "pillow>=10.0" \
    "grpcio>=1.67.1" "grpcio-health-checking>=1.67.1" "uvloop>=0.19" "pytest>=7.4" \
    "onnx>=1.15" "setuptools>=77" wheel
# /proc and /sys for the chroot: ONNX Runtime reads the CPU topology from /sys at import
mkdir -p "$R/proc" "$R/sys" "$R/dev/shm"
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mountpoint -q "$R/sys" || mount -t sysfs -o ro sysfs "$R/sys"
mountpoint -q "$R/dev/shm" || mount -t tmpfs tmpfs "$R/dev/shm"
trap 'umount "$R/dev/shm" "$R/sys" "$R/proc" 2>/dev/null || true' EXIT

if ! chroot "$R" /opt/venv/bin/python -c 'import appliance, pytest, onnx' 2>/dev/null; then
    mkdir -p "$R/tmp/wheels"
    cp "$wheels"/*.whl "$R/tmp/wheels/"
    cp "$WORK/arm64-pins.txt" "$R/tmp/wheels/"
    chroot "$R" python3 -m venv /opt/venv
    chroot "$R" /opt/venv/bin/pip install --quiet --disable-pip-version-check --no-index \
        --find-links /tmp/wheels -c /tmp/wheels/arm64-pins.txt --upgrade "setuptools>=77" wheel
    chroot "$R" /bin/sh -c 'cd /src && /opt/venv/bin/pip install --quiet --disable-pip-version-check \
        --no-index --find-links /tmp/wheels --no-build-isolation -c /tmp/wheels/arm64-pins.txt \
        ".[grpc,uvloop,client]" pytest onnx'
fi
installed=$(( $(date +%s) - started ))
echo "arm64-check: installed after ${installed} s:" \
    "$(chroot "$R" /opt/venv/bin/python -c 'import platform, onnxruntime, numpy; print(platform.machine(), "onnxruntime", onnxruntime.__version__, "numpy", numpy.__version__)')"

# the core end-to-end tests, on loopback inside the chroot (the installed package
# brings the dependencies; the tests import the copy in /src)
test_started=$(date +%s)
set +e
chroot "$R" /bin/sh -c "cd /src && PATH=/opt/venv/bin:/usr/sbin:\$PATH /opt/venv/bin/python -m pytest \
    -q -p no:cacheprovider ${TESTS[*]}" 2>&1 | tee "$WORK/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "arm64-check: tests took $(( $(date +%s) - test_started )) s under emulation, exit $status;" \
    "total $(( $(date +%s) - started )) s"
exit "$status"
