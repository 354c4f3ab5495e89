#!/usr/bin/env bash
# Build a bootable x86-64 Debian bookworm disk image with the appliance, using
# Debian's own tools and no loop device, no mounts:
#
#   debootstrap          -> a root filesystem in a folder
#   chroot               -> the appliance in /opt/appliance/venv, units enabled,
#                           config in /etc/appliance, models under /var/lib/appliance,
#                           laid out for A/B software updates (install-appliance.sh)
#   mkfs.ext4 -d         -> an ext4 filesystem image made from that folder
#   sfdisk + dd          -> an MBR disk with one partition holding it
#   grub-mkimage + dd    -> GRUB's boot.img in the MBR and core.img behind it (core.img's
#                           own block list already points at the sectors after it, so
#                           grub-install, which needs the disk as a device, is not used)
#
# Usage (as root; needs debootstrap, e2fsprogs, fdisk, grub-pc-bin, and the Debian
# archive and the Python package index reachable):
#   images/build-image.sh [OUT_DIR]          # default: images/out
# Result: OUT_DIR/appliance-bookworm-amd64.img (raw disk; boot it with
# images/boot-test.sh, or write it to a disk with dd/bmaptool).
set -euo pipefail

for tool in debootstrap mkfs.ext4 sfdisk grub-mkimage systemd-sysusers python3; do
    command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v "$tool" >/dev/null || {
        echo "build-image.sh: $tool is missing (Debian: debootstrap e2fsprogs fdisk grub-pc-bin systemd)" >&2
        exit 1
    }
done
[ -f /usr/lib/grub/i386-pc/boot.img ] || { echo "build-image.sh: install grub-pc-bin" >&2; exit 1; }

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
OUT=${1:-$HERE/out}
SUITE=bookworm
IMAGE=$OUT/appliance-$SUITE-amd64.img
WORK=$(mktemp -d /var/tmp/appliance-image.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
ROOTFS=$WORK/rootfs
mkdir -p "$OUT" "$ROOTFS"
started=$(date +%s)

# ---- 1. the root filesystem -----------------------------------------------------
# minbase + what boots and serves: systemd as init, udev, a kernel (its initramfs
# finds the root filesystem by UUID), Python 3.11 for the venv, CA certificates, and
# polkitd: the update agent (user appliance) restarts the server through systemd after
# a software update (systemd/appliance-ota.polkit.rules allows that one unit)
debootstrap --variant=minbase --arch=amd64 \
    --include=systemd,systemd-sysv,udev,dbus,polkitd,libpam-systemd,linux-image-amd64,initramfs-tools,python3,python3-venv,ca-certificates,iproute2,kmod \
    "$SUITE" "$ROOTFS"

# ---- 2. the appliance's Python environment --------------------------------------
# wheels are fetched here, on the build host, with its pip settings, then installed in
# the chroot from that folder alone (the chroot needs no index access); the pins are
# constraints.txt's (Python 3.11, as bookworm's python3); the ota extra: the update
# agent runs from this environment too (and its rescue always does)
wheels=$WORK/wheels
src=$WORK/src
mkdir -p "$src"
tar -C "$ROOT" --exclude=.git --exclude=images/out --exclude='*.egg-info' --exclude=build \
    --exclude=__pycache__ -cf - . | tar -xf - -C "$src"
python3 -m pip wheel --quiet --disable-pip-version-check -w "$wheels" \
    -c "$src/constraints.txt" "$src[grpc,uvloop,ota]"
mkdir -p "$ROOTFS/tmp/wheels"
cp "$wheels"/*.whl "$ROOTFS/tmp/wheels/"
cp "$src/constraints.txt" "$ROOTFS/tmp/wheels/"
chroot "$ROOTFS" python3 -m venv /opt/appliance/venv
chroot "$ROOTFS" /opt/appliance/venv/bin/pip install --quiet --disable-pip-version-check \
    --no-index --find-links /tmp/wheels -c /tmp/wheels/constraints.txt 'appliance[grpc,uvloop,ota]'
chroot "$ROOTFS" /opt/appliance/venv/bin/python -m compileall -q /opt/appliance/venv
rm -rf "$ROOTFS/tmp/wheels"
mkdir -p "$ROOTFS/opt/appliance/docs"
cp "$ROOT/docs/deployment.md" "$ROOT/docs/ota.md" "$ROOTFS/opt/appliance/docs/" 2>/dev/null || true

# ---- 3. units, user, config, models, first boot ---------------------------------
"$HERE/install-appliance.sh" "$ROOTFS"

# ---- 4. what any Debian system image needs ----------------------------------------
uuid=$(cat /proc/sys/kernel/random/uuid)
echo "UUID=$uuid / ext4 errors=remount-ro 0 1" > "$ROOTFS/etc/fstab"
echo appliance > "$ROOTFS/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 appliance\n' > "$ROOTFS/etc/hosts"
# an empty machine-id: systemd makes one on first boot (and knows it is the first)
: > "$ROOTFS/etc/machine-id"
rm -f "$ROOTFS/var/lib/dbus/machine-id"
mkdir -p "$ROOTFS/etc/systemd/network"
cat > "$ROOTFS/etc/systemd/network/20-wired.network" <<'EOF'
[Match]
Name=en* eth*

[Network]
DHCP=yes
EOF
chroot "$ROOTFS" systemctl enable systemd-networkd.service
# qemu's user network answers DNS here; a device on a real network gets its resolver by
# DHCP when systemd-resolved is added, or an edited /etc/resolv.conf
echo "nameserver 10.0.2.3" > "$ROOTFS/etc/resolv.conf"
# root cannot log in with a password; the serial console shows the boot
chroot "$ROOTFS" passwd -l root >/dev/null
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin

# ---- 5. GRUB configuration --------------------------------------------------------
kernel=$(cd "$ROOTFS/boot" && ls vmlinuz-* | sort -V | tail -1)
initrd=initrd.img-${kernel#vmlinuz-}
mkdir -p "$ROOTFS/boot/grub"
cat > "$ROOTFS/boot/grub/grub.cfg" <<EOF
set timeout=1
set default=0
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
menuentry "appliance (Debian $SUITE)" {
    linux /boot/$kernel root=UUID=$uuid ro console=tty0 console=ttyS0,115200n8 quiet
    initrd /boot/$initrd
}
EOF

# ---- 6. filesystem image, disk image, boot loader --------------------------------
used_mib=$(du -sm "$ROOTFS" | cut -f1)
venv_mib=$(du -sm "$ROOTFS/opt/appliance/venv" | cut -f1)
# room for models, logs, and software updates: two more environments of the venv's size
# (the new version, and a candidate while the committed one and its predecessor are
# kept) plus the bundle and its unpacked wheels while one is installed
fs_mib=$((used_mib * 13 / 10 + 256 + 2 * venv_mib + 512))
fs=$WORK/root.ext4
mkfs.ext4 -q -F -L appliance-root -U "$uuid" -d "$ROOTFS" "$fs" "${fs_mib}M"
rm -f "$IMAGE"
truncate -s $((fs_mib + 1))M "$IMAGE"
printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk --quiet "$IMAGE"
dd if="$fs" of="$IMAGE" bs=1M seek=1 conv=notrunc,sparse status=none
grub=/usr/lib/grub/i386-pc
grub-mkimage -O i386-pc -o "$WORK/core.img" -p '(hd0,msdos1)/boot/grub' \
    biosdisk part_msdos ext2 normal linux configfile search serial terminal echo test
core_sectors=$(( ($(stat -c %s "$WORK/core.img") + 511) / 512 ))
[ "$core_sectors" -lt 2047 ] || { echo "core.img does not fit before the partition" >&2; exit 1; }
dd if="$grub/boot.img" of="$IMAGE" bs=440 count=1 conv=notrunc status=none
dd if="$WORK/core.img" of="$IMAGE" bs=512 seek=1 conv=notrunc status=none

echo "image: $IMAGE"
echo "size: $(du -h --apparent-size "$IMAGE" | cut -f1) apparent, $(du -h "$IMAGE" | cut -f1) on disk"
echo "root filesystem: ${used_mib} MiB used of ${fs_mib} MiB; kernel $kernel"
echo "built in $(( $(date +%s) - started )) s"
