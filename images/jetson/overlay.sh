#!/usr/bin/env bash
# Put the appliance into an L4T root filesystem before NVIDIA's flashing tool writes it
# to a Jetson: the same venv layout (/opt/appliance/venv), units, user, config and state
# folders as the x86 image (images/install-appliance.sh), plus the GPU drop-in.
#
#   sudo images/jetson/overlay.sh Linux_for_Tegra/rootfs [WHEEL_DIR]
#
# Run it after NVIDIA's apply_binaries.sh (the rootfs then has L4T's libraries and
# /etc/nv_tegra_release) and before flash.sh / l4t_initrd_flash.sh. The host needs
# qemu-user-static with binfmt (Debian/Ubuntu: qemu-user-static) to run the rootfs's
# aarch64 Python in a chroot, and network access to the package index.
#
# WHEEL_DIR (default: wheels/ of this repository) must hold NVIDIA's onnxruntime-gpu
# wheel for JetPack 6 (cp310, linux_aarch64); it replaces the CPU build of ONNX Runtime.
# pycuda (TensorRT backend) is compiled against the device's CUDA: on the device, run
#   sudo /opt/appliance/venv/bin/pip install -c /opt/appliance/constraints-jetson.txt pycuda
# TensorRT's Python bindings come from JetPack (python3-libnvinfer) through the venv's
# --system-site-packages.
#
# What only real hardware checks: the flash itself, GPU device access under the unit's
# sandbox (appliance.service.d/jetson-gpu.conf), ONNX Runtime's CUDA and TensorRT
# execution providers, the TensorRT backend, memory figures on unified memory.
# `appliance doctor` on the device reports each of these.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
R=${1:?usage: overlay.sh Linux_for_Tegra/rootfs [WHEEL_DIR]}
WHEELS=${2:-$ROOT/wheels}
R=$(cd "$R" && pwd)

[ -f "$R/etc/nv_tegra_release" ] || {
    echo "overlay.sh: $R/etc/nv_tegra_release is missing: run apply_binaries.sh first" >&2
    exit 1
}
[ -x "$R/usr/bin/python3" ] || { echo "overlay.sh: no python3 in $R" >&2; exit 1; }
ort=$(ls "$WHEELS"/onnxruntime_gpu-*-cp310-*linux_aarch64.whl 2>/dev/null | tail -1 || true)
[ -n "$ort" ] || {
    echo "overlay.sh: put NVIDIA's onnxruntime-gpu wheel for JetPack 6 into $WHEELS" >&2
    exit 1
}

# the package and its pins, staged inside the rootfs for the chroot's pip
stage=$R/tmp/appliance-overlay
saved=$R/tmp/appliance-overlay.resolv
rm -rf "$stage"
mkdir -p "$stage/src"
tar -C "$ROOT" --exclude=.git --exclude=images/out --exclude='*.egg-info' --exclude=build \
    --exclude=__pycache__ -cf - pyproject.toml README.md LICENSE constraints-jetson.txt \
    appliance | tar -xf - -C "$stage/src"
cp "$ort" "$stage/"
# pip in the chroot needs a resolver: L4T's /etc/resolv.conf points into /run, which is
# empty here, so the host's is put in place for the install and the link restored after
mv "$R/etc/resolv.conf" "$saved" 2>/dev/null || true
cp -L /etc/resolv.conf "$R/etc/resolv.conf"
restore() {
    rm -f "$R/etc/resolv.conf"
    if [ -e "$saved" ] || [ -L "$saved" ]; then mv "$saved" "$R/etc/resolv.conf"; fi
    rm -rf "$stage"
}
trap restore EXIT

in_root() { chroot "$R" "$@"; }
in_root python3 -m venv --system-site-packages /opt/appliance/venv
in_root /opt/appliance/venv/bin/pip install --quiet --disable-pip-version-check \
    -c /tmp/appliance-overlay/src/constraints-jetson.txt '/tmp/appliance-overlay/src[grpc,uvloop]'
in_root /opt/appliance/venv/bin/pip uninstall --quiet -y onnxruntime
in_root /opt/appliance/venv/bin/pip install --quiet --disable-pip-version-check --no-deps \
    "/tmp/appliance-overlay/$(basename "$ort")"
in_root /opt/appliance/venv/bin/python -m compileall -q /opt/appliance/venv
install -D -m 0644 "$ROOT/constraints-jetson.txt" "$R/opt/appliance/constraints-jetson.txt"

"$ROOT/images/install-appliance.sh" "$R"
install -D -m 0644 "$ROOT/systemd/appliance.service.d/jetson-gpu.conf" \
    "$R/etc/systemd/system/appliance.service.d/jetson-gpu.conf"
echo "overlay.sh: appliance installed into $R ($(du -sh "$R/opt/appliance" | cut -f1) in /opt/appliance)"
