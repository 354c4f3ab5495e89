#!/usr/bin/env bash
# Install the appliance's system files into a root filesystem: the units, the service
# user, /etc/appliance, /var/lib/appliance with the demo models, and the first-boot
# device-id step. Used by build-image.sh (x86 Debian image) and jetson/overlay.sh
# (L4T's Linux_for_Tegra/rootfs); the venv at /opt/appliance/venv must exist already.
#
#   images/install-appliance.sh ROOTFS
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
R=${1:?usage: install-appliance.sh ROOTFS}
[ -x "$R/opt/appliance/venv/bin/appliance" ] || {
    echo "install-appliance.sh: $R/opt/appliance/venv/bin/appliance is missing" >&2
    exit 1
}

install -D -m 0644 "$ROOT/systemd/appliance.service" "$R/etc/systemd/system/appliance.service"
install -D -m 0644 "$ROOT/systemd/appliance-ota.service" \
    "$R/etc/systemd/system/appliance-ota.service"
install -D -m 0644 "$ROOT/systemd/appliance.sysusers" "$R/usr/lib/sysusers.d/appliance.conf"
install -D -m 0755 "$HERE/firstboot/appliance-firstboot" "$R/usr/local/sbin/appliance-firstboot"
install -D -m 0644 "$HERE/firstboot/appliance-firstboot.service" \
    "$R/etc/systemd/system/appliance-firstboot.service"

# the service user now (systemd-sysusers reads the file above), so files can be its own;
# --root: the host's tools work on a foreign-architecture rootfs (Jetson) without a chroot
systemd-sysusers --root="$R"
uid=$(awk -F: '$1 == "appliance" {print $3 ":" $4}' "$R/etc/passwd")
[ -n "$uid" ] || { echo "install-appliance.sh: no appliance user in $R/etc/passwd" >&2; exit 1; }
install -d -m 0755 "$R/etc/appliance"
if [ ! -f "$R/etc/appliance/appliance.yaml" ]; then
    install -m 0640 "$HERE/appliance.yaml" "$R/etc/appliance/appliance.yaml"
    chown "0:${uid#*:}" "$R/etc/appliance/appliance.yaml"
fi
install -d -m 0750 "$R/var/lib/appliance" "$R/var/lib/appliance/models" "$R/var/lib/appliance/ota"
demo=$(echo "$R"/opt/appliance/venv/lib/python3*/site-packages/appliance/demo_models)
cp -r "$demo"/. "$R/var/lib/appliance/models/"
chown -R "$uid" "$R/var/lib/appliance"

# the server and its first-boot step start at boot; the OTA agent's unit is installed,
# and enabled once the agent ships (systemctl enable appliance-ota)
systemctl --root="$R" enable appliance-firstboot.service appliance.service
