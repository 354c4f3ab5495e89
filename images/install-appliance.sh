#!/usr/bin/env bash
# Install the appliance's system files into a root filesystem: the units, the service
# user, /etc/appliance, /var/lib/appliance with the demo models, the first-boot
# device-id step, and the A/B layout of software updates (docs/ota.md, "Software
# updates"). Used by build-image.sh (x86 Debian image) and jetson/overlay.sh
# (L4T's Linux_for_Tegra/rootfs); the venv at /opt/appliance/venv must exist already.
#
# The A/B layout, under the agent's state folder /var/lib/appliance/ota/software/:
#   envs/<version> -> /opt/appliance/venv   the image's own environment is the first
#                                           version (a link: the agent never removes
#                                           it; the rescue unit runs from it)
#   current -> envs/<version>                what both units run (their ab.conf drop-ins)
#   state.json                               {"committed": "<version>", ...}
# Updates add envs/<new version>/ beside it and flip `current`.
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
# both units run from the A/B link; the agent's unit starts the rescue when a new
# agent cannot start; the agent (user appliance) may restart the server (polkit)
install -D -m 0644 "$ROOT/systemd/appliance.service.d/ab.conf" \
    "$R/etc/systemd/system/appliance.service.d/ab.conf"
install -D -m 0644 "$ROOT/systemd/appliance-ota.service.d/ab.conf" \
    "$R/etc/systemd/system/appliance-ota.service.d/ab.conf"
install -D -m 0644 "$ROOT/systemd/appliance-ota-rescue.service" \
    "$R/etc/systemd/system/appliance-ota-rescue.service"
install -D -m 0644 "$ROOT/systemd/appliance-ota.polkit.rules" \
    "$R/etc/polkit-1/rules.d/50-appliance-ota.rules"
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

# the A/B layout (above); the version from the installed wheel's metadata (no Python
# of the target's architecture needed). The marker says the env is complete, as the
# agent's own installs do
dist=$(echo "$R"/opt/appliance/venv/lib/python3*/site-packages/appliance-*.dist-info)
version=$(sed -n 's/^Version: //p' "$dist/METADATA" | head -1)
[ -n "$version" ] || { echo "install-appliance.sh: no appliance version in $dist" >&2; exit 1; }
sw=$R/var/lib/appliance/ota/software
if [ ! -e "$sw/state.json" ]; then
    printf '{"name": "appliance", "version": "%s", "installed_by": "the image"}\n' "$version" \
        > "$R/opt/appliance/venv/.installed"
    install -d -m 0750 "$sw" "$sw/envs"
    ln -sfn /opt/appliance/venv "$sw/envs/$version"
    ln -sfn "envs/$version" "$sw/current"
    printf '{"bad": [], "committed": "%s", "job": null}\n' "$version" > "$sw/state.json"
fi
# -h: the links themselves, never what they point at (the image's venv stays root's)
chown -hR "$uid" "$R/var/lib/appliance"

# the server and its first-boot step start at boot; the OTA agent's unit is installed,
# and enabled on a device once its fleet's `ota:` section (source, pinned root) is in
# /etc/appliance/appliance.yaml: systemctl enable --now appliance-ota
systemctl --root="$R" enable appliance-firstboot.service appliance.service
