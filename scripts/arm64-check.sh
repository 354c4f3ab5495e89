#!/usr/bin/env bash
# Prove the CPU path on arm64 (Jetson, most edge boards) on an x86 machine: an arm64
# Debian bookworm chroot run through qemu-user emulation, the package installed from
# aarch64 wheels, and the core end-to-end tests run inside it (serving the demo and
# generated models, tritonclient inference, dynamic batching, hot swap).
#
#   sudo scripts/arm64-check.sh [--fresh] [WORK_DIR]   # default: /var/tmp/appliance-arm64
#
# --fresh deletes WORK_DIR first (its chroot and venv), so the run proves a first install;
# without it a chroot left by an earlier run is reused, and the log says so.
#
# Needs debootstrap, a qemu-aarch64 user-mode emulator (its binfmt handler is registered
# here when the host has none, or replaced when it names another emulator) and the
# Debian archive and package index reachable.
#
# Which emulator: QEMU_AARCH64=/path/to/qemu-aarch64, else qemu-aarch64-static on PATH.
# With qemu 8 or newer (trixie's qemu-user 10 ships static binaries; `dpkg-deb -x` its
# .deb and point QEMU_AARCH64 at usr/bin/qemu-aarch64) the check installs the versions
# constraints.txt pins, as a device would. Bookworm's qemu-user 7.2 crashes in
# onnxruntime 1.32, so with it the check pins onnxruntime 1.19.2 and numpy 1.26.4 instead
# and says so. Timing figures under emulation say nothing about a device; the script
# reports what ran and how long it took.
#
# What is installed is what pyproject.toml asks for: the project's wheel is built here
# and pip resolves it with its extras for aarch64 (no package list of the script's own).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
fresh=0
if [ "${1:-}" = "--fresh" ]; then
    fresh=1
    shift
fi
WORK=${1:-/var/tmp/appliance-arm64}
R=$WORK/rootfs
EXTRAS="grpc,uvloop,client"
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

# commands in the chroot get a device's environment, not this host's (its pip settings,
# CI variables and the like)
in_chroot() {
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 TMPDIR=/tmp chroot "$R" "$@"
}
unmount_chroot() {
    for m in "$R/dev/shm" "$R/sys" "$R/proc"; do
        if mountpoint -q "$m" 2>/dev/null; then umount "$m"; fi
    done
}
if [ "$fresh" = 1 ] && [ -e "$WORK" ]; then
    unmount_chroot
    rm -rf --one-file-system "$WORK"
    echo "arm64-check: --fresh: removed $WORK"
fi

# aarch64 executables run through qemu: register the handler (F: the interpreter is
# opened now, so it works inside the chroot without a copy there)
QEMU=${QEMU_AARCH64:-$(command -v qemu-aarch64-static || true)}
if [ -z "$QEMU" ] || [ ! -x "$QEMU" ]; then
    echo "arm64-check: no qemu-aarch64 emulator (install qemu-user-static or set QEMU_AARCH64)" >&2
    exit 2
fi
QEMU=$(readlink -f "$QEMU")
qemu_version=$("$QEMU" --version | sed -n 's/.*version \([0-9][0-9.]*\).*/\1/p' | head -1)
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
handler=/proc/sys/fs/binfmt_misc/qemu-aarch64
if [ -e "$handler" ] && ! grep -qx "interpreter $QEMU" "$handler"; then
    echo "arm64-check: replacing the aarch64 binfmt handler ($(sed -n 's/^interpreter //p' "$handler")) with $QEMU"
    echo -1 > "$handler"
fi
if [ ! -e "$handler" ]; then
    magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qemu-aarch64:M::$magic:$mask:$QEMU:F" > /proc/sys/fs/binfmt_misc/register
fi

reused=fresh
if [ -x "$R/usr/bin/python3" ]; then
    reused="reused from an earlier run"
else
    mkdir -p "$WORK"
    debootstrap --variant=minbase --arch=arm64 --include=python3,python3-venv,mosquitto \
        bookworm "$R"
fi
echo "arm64-check: chroot ($reused) ready after $(( $(date +%s) - started )) s" \
    "($(in_chroot uname -m), qemu $qemu_version at $QEMU)"

# the pins: constraints.txt, or the two an old qemu can run (see the header)
pins=$WORK/arm64-pins.txt
if [ "${qemu_version%%.*}" -ge 8 ]; then
    cp "$ROOT/constraints.txt" "$pins"
else
    printf 'onnxruntime==1.19.2\nnumpy==1.26.4\n' > "$pins"
    echo "arm64-check: qemu $qemu_version: pinning onnxruntime 1.19.2 and numpy 1.26.4"
fi

# the source tree for the tests (/src), and the project's wheel built from a copy of it
wheels=$WORK/wheels
rm -rf "$wheels" "$R/src" "$WORK/build"
mkdir -p "$wheels" "$R/src" "$WORK/build"
for dest in "$R/src" "$WORK/build"; do
    tar -C "$ROOT" --exclude=.git --exclude=images/out --exclude='*.egg-info' --exclude=build \
        --exclude=__pycache__ -cf - . | tar -xf - -C "$dest"
done
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$wheels" "$WORK/build"
# aarch64 wheels for Python 3.11 (bookworm's) of everything the project requires with
# its extras, resolved by pip from the wheel's metadata, fetched on the host
python3 -m pip download --quiet --disable-pip-version-check -d "$wheels" \
    --find-links "$wheels" \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp \
    --only-binary=:all: -c "$pins" "appliance[$EXTRAS]" "pytest>=7.4" "onnx>=1.15"
# /proc and /sys for the chroot: ONNX Runtime reads the CPU topology from /sys at import
mkdir -p "$R/proc" "$R/sys" "$R/dev/shm"
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mountpoint -q "$R/sys" || mount -t sysfs -o ro sysfs "$R/sys"
mountpoint -q "$R/dev/shm" || mount -t tmpfs tmpfs "$R/dev/shm"
trap 'unmount_chroot 2>/dev/null || true' EXIT

# install every run (pip skips what is already there); the project itself is always
# reinstalled, so a reused venv never tests an older copy or misses a new dependency
rm -rf "$R/tmp/wheels"
mkdir -p "$R/tmp/wheels"
cp "$wheels"/*.whl "$pins" "$R/tmp/wheels/"
[ -x "$R/opt/venv/bin/python" ] || in_chroot python3 -m venv /opt/venv
in_chroot /opt/venv/bin/pip install --quiet --disable-pip-version-check --no-index \
    --find-links /tmp/wheels -c "/tmp/wheels/$(basename "$pins")" \
    "appliance[$EXTRAS]" "pytest>=7.4" "onnx>=1.15"
in_chroot /opt/venv/bin/pip install --quiet --disable-pip-version-check --no-index \
    --find-links /tmp/wheels --no-deps --force-reinstall appliance
installed=$(( $(date +%s) - started ))
echo "arm64-check: installed after ${installed} s:" \
    "$(in_chroot /opt/venv/bin/python -c 'import platform, onnxruntime, numpy; print(platform.machine(), "onnxruntime", onnxruntime.__version__, "numpy", numpy.__version__)')"

# the core end-to-end tests, on loopback inside the chroot (the installed package
# brings the dependencies; the tests import the copy in /src)
test_started=$(date +%s)
set +e
# emulation runs every step many times slower: the tests' bounded waits and the
# blocking detector's threshold are scaled by APPLIANCE_TEST_SLOWDOWN (tests/pace.py)
slowdown=${APPLIANCE_TEST_SLOWDOWN:-10}
in_chroot /bin/sh -c "cd /src && PATH=/opt/venv/bin:\$PATH APPLIANCE_TEST_SLOWDOWN=$slowdown \
    /opt/venv/bin/python -m pytest \
    -q -p no:cacheprovider ${TESTS[*]}" 2>&1 | tee "$WORK/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "arm64-check: tests took $(( $(date +%s) - test_started )) s under emulation" \
    "(waits scaled x$slowdown), exit $status;" \
    "total $(( $(date +%s) - started )) s"
exit "$status"
