#!/usr/bin/env bash
# Boot the device image under software emulation and check it serves:
#
#   images/boot-test.sh [IMAGE]     # default: images/out/appliance-bookworm-amd64.img
#
# 1. copies the image and adds a test-only unit to the copy (debugfs, no mount): once
#    appliance.service is active (Type=notify: its models are READY) it prints
#    `systemctl show appliance.service` to the serial console, waits for the demo
#    inference below to have been served, prints it again, and powers the guest off;
# 2. boots the copy with qemu-system-x86_64 -accel tcg (no KVM needed), the guest's
#    port 8000 forwarded to a free port on the host's loopback only;
# 3. waits for /v2/health/ready (boot-to-ready time), runs a demo inference (`simple`:
#    a + 1), checks the unit was active with its watchdog armed and pinged and that the
#    server runs from the A/B link (/var/lib/appliance/ota/software/current), shows what
#    `appliance doctor` says on the device (no check may fail), and waits for the guest
#    to power off.
# Not part of the test suite (it takes minutes); needs qemu-system-x86 and e2fsprogs.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
IMAGE=${1:-$HERE/out/appliance-bookworm-amd64.img}
BOOT_TIMEOUT=${BOOT_TIMEOUT:-900}
work=$(mktemp -d /var/tmp/appliance-boot.XXXXXX)
qemu_pid=""
cleanup() {
    if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then kill "$qemu_pid"; fi
    rm -rf "$work"
}
trap cleanup EXIT

cp --sparse=always "$IMAGE" "$work/disk.img"
offset=$((2048 * 512))  # the root partition (build-image.sh)
cat > "$work/boot-test-report.service" <<'EOF'
[Unit]
Description=boot test: report appliance.service, then power off
Requires=appliance.service
After=appliance.service

[Service]
Type=oneshot
StandardOutput=tty
TTYPath=/dev/ttyS0
ExecStart=/bin/sh -c 'echo "BOOT-TEST-REPORT $$(systemctl show appliance.service -p ActiveState -p SubState -p WatchdogUSec -p WatchdogTimestampMonotonic -p NRestarts | tr "\\n" " ")"'
ExecStart=/bin/sh -c 'echo "BOOT-TEST-AB current=$$(readlink /var/lib/appliance/ota/software/current) server=$$(tr "\\0" " " < /proc/$$(systemctl show -p MainPID --value appliance.service)/cmdline)"'
ExecStart=/opt/appliance/venv/bin/python /usr/local/lib/boot-test/wait-for-inference.py
ExecStart=/bin/sh -c 'echo "BOOT-TEST-REPORT $$(systemctl show appliance.service -p ActiveState -p SubState -p WatchdogUSec -p WatchdogTimestampMonotonic -p NRestarts | tr "\\n" " ")"'
ExecStart=-/bin/sh -c '/opt/appliance/venv/bin/appliance doctor --config /etc/appliance/appliance.yaml | sed "s/^/BOOT-TEST-DOCTOR /"'
ExecStart=/bin/systemctl --no-block poweroff
EOF
# the step that waits for the host's inference (counted in the server's metrics)
cat > "$work/wait-for-inference.py" <<'EOF'
import time
import urllib.request

for _ in range(600):
    text = urllib.request.urlopen("http://127.0.0.1:8002/metrics", timeout=5).read().decode()
    served = [
        line for line in text.splitlines()
        if line.startswith('nv_inference_request_success{model="simple"')
    ]
    if served and not served[0].endswith(" 0"):
        break
    time.sleep(1)
EOF
cat > "$work/debugfs.cmd" <<EOF
mkdir /usr/local/lib/boot-test
write $work/wait-for-inference.py /usr/local/lib/boot-test/wait-for-inference.py
write $work/boot-test-report.service /etc/systemd/system/boot-test-report.service
symlink /etc/systemd/system/multi-user.target.wants/boot-test-report.service /etc/systemd/system/boot-test-report.service
EOF
debugfs -w -f "$work/debugfs.cmd" "$work/disk.img?offset=$offset" >/dev/null

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
started=$(date +%s.%N)
qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2048 \
    -drive "file=$work/disk.img,format=raw,if=virtio" \
    -nic "user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:$port-:8000" \
    -display none -monitor none -serial "file:$work/serial.log" -no-reboot &
qemu_pid=$!

echo "boot-test: booting $(basename "$IMAGE") under TCG, guest port 8000 on 127.0.0.1:$port"
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v2/health/ready', timeout=5)" 2>/dev/null; do
    kill -0 "$qemu_pid" 2>/dev/null || { echo "boot-test: qemu exited"; tail -40 "$work/serial.log"; exit 1; }
    if [ "$(echo "$(date +%s.%N) - $started > $BOOT_TIMEOUT" | bc)" = 1 ]; then
        echo "boot-test: not ready after ${BOOT_TIMEOUT}s"; tail -40 "$work/serial.log"; exit 1
    fi
    sleep 0.5
done
ready_s=$(echo "$(date +%s.%N) - $started" | bc)
echo "boot-test: ready ${ready_s}s after power-on"

python3 - "$port" <<'EOF'
import json
import sys
import urllib.request

port = sys.argv[1]
request = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}
req = urllib.request.Request(
    f"http://127.0.0.1:{port}/v2/models/simple/infer", data=json.dumps(request).encode()
)
answer = json.load(urllib.request.urlopen(req, timeout=60))
out = next(o for o in answer["outputs"] if o["name"] == "OUTPUT0")
assert out["data"] == [x + 1 for x in range(16)], out
print("boot-test: demo inference ok (simple: a + 1)")
EOF

for _ in $(seq 300); do
    kill -0 "$qemu_pid" 2>/dev/null || break
    sleep 1
done
if kill -0 "$qemu_pid" 2>/dev/null; then
    echo "boot-test: the guest did not power off"; tail -40 "$work/serial.log"; exit 1
fi
wait "$qemu_pid" || true
qemu_pid=""
total_s=$(echo "$(date +%s.%N) - $started" | bc)

mapfile -t reports < <(grep -a 'BOOT-TEST-REPORT' "$work/serial.log" | tr -d '\r')
[ "${#reports[@]}" -ge 2 ] || { echo "boot-test: no unit report on the console"; tail -40 "$work/serial.log"; exit 1; }
last=${reports[-1]}
echo "boot-test: ${last#*BOOT-TEST-REPORT }"
case "$last" in *ActiveState=active*) ;; *) echo "boot-test: unit not active"; exit 1 ;; esac
case "$last" in *WatchdogUSec=0*|*WatchdogUSec=\ *) echo "boot-test: no watchdog"; exit 1 ;; esac
case "$last" in *WatchdogUSec=*) ;; *) echo "boot-test: no watchdog"; exit 1 ;; esac
case "$last" in *WatchdogTimestampMonotonic=0\ *) echo "boot-test: watchdog never pinged"; exit 1 ;; esac
# the server runs from the A/B link (docs/ota.md, "Software updates"), not the image's venv
ab=$(grep -a 'BOOT-TEST-AB' "$work/serial.log" | tr -d '\r' | tail -1)
echo "boot-test: ${ab#*BOOT-TEST-AB }"
case "$ab" in *"current=envs/"*"/var/lib/appliance/ota/software/current/bin/appliance serve"*) ;;
    *) echo "boot-test: the server does not run from the A/B link"; exit 1 ;; esac
grep -a "appliance-firstboot: device id" "$work/serial.log" | tr -d '\r' | tail -1 || true
# `appliance doctor` on the booted device, as the engineer would run it
grep -a "BOOT-TEST-DOCTOR" "$work/serial.log" | tr -d '\r' | sed 's/^.*BOOT-TEST-DOCTOR /doctor: /' || true
if grep -a "BOOT-TEST-DOCTOR \[fail\]" "$work/serial.log" >/dev/null; then
    echo "boot-test: appliance doctor reports a failure"; exit 1
fi

echo "boot-test: PASS  image $(du -h --apparent-size "$IMAGE" | cut -f1) (on disk $(du -h "$IMAGE" | cut -f1)), ready ${ready_s}s after power-on under TCG, powered off after ${total_s}s"
