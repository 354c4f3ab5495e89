#!/usr/bin/env bash
# Update the booted device image's own software under real systemd, offline, and roll
# a bad release back (docs/ota.md, "Software updates" and "Offline import"):
#
#   images/update-test.sh [IMAGE]     # default: images/out/appliance-bookworm-amd64.img
#
# On the host, with the project's own tools:
# 1. two wheels of this project at the next patch versions after the image's (its
#    committed version, read from the image): a good one, and a bad one whose server
#    cannot start (Server.__init__ exits, as tests/ota_software.py makes one);
# 2. two software bundles (`appliance bundle build-software --python 3.11 --platform
#    x86_64`: the wheels of the pinned dependencies downloaded by pip for the guest's
#    bookworm Python, cp311 manylinux x86_64), a real TUF repository (`appliance fleet
#    keys/init/publish`) and two offline import files (`appliance fleet export`): the
#    good release, then the bad one;
# 3. copies the image and adds to the copy (debugfs, no mount): the repository's pinned
#    root, the two import files, and a test-only unit that drives the device as an
#    operator at a site without network would (below);
# 4. boots the copy with qemu-system-x86_64 -accel tcg, the guest's port 8000 forwarded
#    to a free port on the host's loopback only, and checks from the host, after each
#    import, the version `/v2` reports, readiness, the models and a demo inference.
#
# In the guest, the test unit (root, after appliance.service is READY): adds an `ota:`
# section (the pinned root; a source that is never reached) to appliance.yaml, starts
# the agent's own unit (appliance-ota.service, from the A/B link), then for each file:
# stops the agent, runs `appliance ota import FILE` from `current` as the service user
# in a transient unit with the agent's sandbox and memory limit (systemd-run), and
# starts the agent again (the new version's agent, after an update). The import
# restarts the server with its restart command (`systemctl restart appliance`, allowed
# to the user appliance by the polkit rule). It reports on the serial console and waits
# for the host's checks (counted in the server's metrics) before the next step.
#
# Prints boot-to-ready, import-to-committed and bad-release-to-rolled-back times.
# Not part of the test suite (it takes many minutes: the guest installs a venv of the
# appliance and its dependencies per release under emulation); needs qemu-system-x86,
# e2fsprogs, and the Python package index for the dependency wheels.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
IMAGE=${1:-$HERE/out/appliance-bookworm-amd64.img}
BOOT_TIMEOUT=${BOOT_TIMEOUT:-900}
STEP_TIMEOUT=${STEP_TIMEOUT:-2400}  # one import, under emulation
WORK=${UPDATE_TEST_WORK:-}  # keep the bundles here (reused when present)
work=$(mktemp -d /var/tmp/appliance-update.XXXXXX)
qemu_pid=""
cleanup() {
    if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then kill "$qemu_pid"; fi
    rm -rf "$work"
}
trap cleanup EXIT
say() { echo "update-test: $*"; }
offset=$((2048 * 512))  # the root partition (build-image.sh)
fs="$IMAGE?offset=$offset"

# ---- 1. the releases ------------------------------------------------------------
committed=$(debugfs -R "cat /var/lib/appliance/ota/software/state.json" "$fs" 2>/dev/null \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["committed"])') || {
    say "$IMAGE is not laid out for A/B (no /var/lib/appliance/ota/software/state.json)"
    exit 1
}
IFS=. read -r major minor patch <<<"$committed"
good=$major.$minor.$((patch + 1))
bad=$major.$minor.$((patch + 2))
say "image's software $committed; good release $good, bad release $bad"

rel=${WORK:-$work/releases}
mkdir -p "$rel"
appliance() { (cd "$ROOT" && python3 -m appliance "$@"); }

wheel() {  # VERSION [broken]: a wheel of this project as VERSION
    local version=$1 src=$work/src-$1
    mkdir -p "$src"
    # what the wheel is built from (as tests/ota_software.py does)
    tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
        -cf - appliance pyproject.toml README.md LICENSE | tar -xf - -C "$src"
    sed -i "0,/^version = \"[^\"]*\"/s//version = \"$version\"/" "$src/pyproject.toml"
    echo "__version__ = \"$version\"" > "$src/appliance/version.py"
    if [ "${2:-}" = broken ]; then
        cat >> "$src/appliance/server.py" <<'EOF'


def _cannot_start(self, *args, **kwargs):
    raise SystemExit("this release cannot start")


Server.__init__ = _cannot_start  # type: ignore[method-assign]
EOF
    fi
    python3 -m pip wheel -q --no-deps -w "$rel/wheel-$version" "$src" >/dev/null
    rm -rf "$src"
    echo "$rel/wheel-$version"/appliance-"$version"-*.whl
}

started=$(date +%s)
for v in "$good" "$bad"; do
    [ -f "$rel/appliance-$v.software" ] && continue
    kind=""; [ "$v" = "$bad" ] && kind=broken
    w=$(wheel "$v" $kind)
    # the guest's Python (bookworm: 3.11) and machine; the extras the image has
    appliance bundle build-software --wheel "$w" --constraints "$ROOT/constraints.txt" \
        --python 3.11 --platform x86_64 --extras grpc,uvloop,ota -o "$rel/appliance-$v.software.tmp"
    mv "$rel/appliance-$v.software.tmp" "$rel/appliance-$v.software"
done
repo=$work/repo
appliance fleet keys "$work/keys" >/dev/null
appliance fleet init "$repo" --keys "$work/keys" >/dev/null
appliance fleet publish "$repo" "$rel/appliance-$good.software" --keys "$work/keys" >/dev/null
appliance fleet export "$repo" -o "$work/good.export" --target "appliance/appliance-$good.software"
appliance fleet publish "$repo" "$rel/appliance-$bad.software" --keys "$work/keys" >/dev/null
appliance fleet export "$repo" -o "$work/bad.export" --target "appliance/appliance-$bad.software"
say "releases, repository and import files made in $(( $(date +%s) - started )) s" \
    "(good $(du -h "$work/good.export" | cut -f1), bad $(du -h "$work/bad.export" | cut -f1))"

# ---- 2. the image copy ----------------------------------------------------------
cp --sparse=always "$IMAGE" "$work/disk.img"
cat > "$work/ota.yaml" <<'EOF'

# added by images/update-test.sh: this device's fleet (offline: the source is never reached)
ota:
  source: http://127.0.0.1:9/
  trusted_root: /etc/appliance/ota-root.json
  check_interval_s: 3600
  software_ready_timeout_s: 600   # the new server's start under emulation
EOF
cat > "$work/update-test.service" <<'EOF'
[Unit]
Description=update test: import a good and a bad software release, then power off
# Wants=, not Requires=: the imports restart appliance.service (and the bad release's
# fails), which would stop or restart a unit that requires it
Wants=appliance.service
After=appliance.service

[Service]
Type=oneshot
TimeoutStartSec=infinity
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
ExecStart=/opt/appliance/venv/bin/python /usr/local/lib/update-test/drive.py
ExecStopPost=/bin/systemctl --no-block poweroff
EOF
cat > "$work/drive.py" <<EOF
GOOD, BAD, STEP_TIMEOUT = "$good", "$bad", $STEP_TIMEOUT
EOF
cat >> "$work/drive.py" <<'EOF'
import json
import pathlib
import subprocess
import time
import urllib.request

SW = pathlib.Path("/var/lib/appliance/ota/software")
CFG = "/etc/appliance/appliance.yaml"
SERVER = "http://127.0.0.1:8000"
# the agent's sandbox (systemd/appliance-ota.service) for the import
SANDBOX = ["MemoryMax=256M", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
           "PrivateDevices=yes", "NoNewPrivileges=yes", "WorkingDirectory=/var/lib/appliance",
           "ReadWritePaths=/var/lib/appliance", "Environment=PYTHONDONTWRITEBYTECODE=1",
           "UMask=0027"]


def say(step, **kw):
    print("UPDATE-TEST " + json.dumps({"step": step, **kw}, sort_keys=True), flush=True)


def get(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(SERVER + path, data=data), timeout=30) as r:
        return json.load(r)


def ready_models():
    return sorted(m["name"] for m in get("/v2/repository/index", {}) if m.get("state") == "READY")


def served():
    with urllib.request.urlopen("http://127.0.0.1:8002/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith('nv_inference_request_success{model="simple"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_host(before):
    end = time.monotonic() + 900
    while time.monotonic() < end and served() <= before:
        time.sleep(1)


def agent(action):
    rc = subprocess.run(["systemctl", action, "appliance-ota.service"], timeout=600).returncode
    show = subprocess.run(["systemctl", "show", "appliance-ota.service", "-p", "ActiveState",
                           "-p", "SubState", "-p", "MainPID", "-p", "NRestarts"],
                          capture_output=True, text=True).stdout.split()
    info = dict(x.split("=", 1) for x in show)
    info["rc"] = rc
    if info.get("MainPID", "0") != "0":
        cmd = pathlib.Path(f"/proc/{info['MainPID']}/cmdline").read_bytes()
        info["cmdline"] = cmd.replace(b"\0", b" ").decode().strip()
    say(f"agent-{action}", **info)


def status():
    done = subprocess.run(["runuser", "-u", "appliance", "--", str(SW / "current/bin/appliance"),
                           "ota", "status", "--config", CFG], capture_output=True, text=True)
    try:
        return json.loads(done.stdout).get("software")
    except ValueError:
        return done.stderr[-300:]


def import_file(name):
    agent("stop")
    t0 = time.monotonic()
    cmd = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", "--uid=appliance",
           "--gid=appliance", "--unit=appliance-ota-import"]
    cmd += [f"--property={p}" for p in SANDBOX]
    cmd += [str(SW / "current/bin/appliance"), "ota", "import", f"/var/lib/update-test/{name}",
            "--config", CFG]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    seconds = round(time.monotonic() - t0, 1)
    for line in done.stderr.splitlines()[-25:]:
        say("import-log", line=line)
    state = json.loads((SW / "state.json").read_text())
    envs = sorted(p.name for p in (SW / "envs").iterdir())
    count = served()  # the host checks once it sees the line below
    say(f"{name}-imported", rc=done.returncode, seconds=seconds, stdout=done.stdout.splitlines(),
        committed=state["committed"], bad=state["bad"], last=state.get("last"),
        current=str((SW / "current").readlink()), envs=envs, version=get("/v2")["version"],
        models=ready_models())
    agent("start")
    say(f"{name}-status", software=status())
    return count


try:
    before = {"version": get("/v2")["version"], "models": ready_models()}
    say("before", **before, current=str((SW / "current").readlink()))
    with open(CFG, "a") as f:
        f.write(pathlib.Path("/usr/local/lib/update-test/ota.yaml").read_text())
    agent("start")  # the agent's own unit, from the A/B link
    wait_for_host(import_file("good.export"))
    wait_for_host(import_file("bad.export"))
    agent("stop")
except Exception as exc:  # reported, then the guest powers off
    say("error", error=f"{type(exc).__name__}: {exc}")
say("done")
EOF
uid=$(debugfs -R "cat /etc/passwd" "$work/disk.img?offset=$offset" 2>/dev/null \
    | awk -F: '$1 == "appliance" {print $3}')
cp "$repo/metadata/1.root.json" "$work/ota-root.json"
cat > "$work/debugfs.cmd" <<EOF
mkdir /usr/local/lib/update-test
write $work/drive.py /usr/local/lib/update-test/drive.py
write $work/ota.yaml /usr/local/lib/update-test/ota.yaml
write $work/ota-root.json /etc/appliance/ota-root.json
mkdir /var/lib/update-test
write $work/good.export /var/lib/update-test/good.export
write $work/bad.export /var/lib/update-test/bad.export
write $work/update-test.service /etc/systemd/system/update-test.service
symlink /etc/systemd/system/multi-user.target.wants/update-test.service /etc/systemd/system/update-test.service
EOF
debugfs -w -f "$work/debugfs.cmd" "$work/disk.img?offset=$offset" >/dev/null 2>&1
# readable by the service user whatever debugfs gave them
for f in /etc/appliance/ota-root.json /var/lib/update-test/good.export /var/lib/update-test/bad.export; do
    debugfs -w -R "set_inode_field $f mode 0100644" "$work/disk.img?offset=$offset" >/dev/null 2>&1
done
debugfs -w -R "set_inode_field /var/lib/update-test mode 040755" "$work/disk.img?offset=$offset" >/dev/null 2>&1
[ -n "$uid" ] || { say "no appliance user in the image"; exit 1; }

# ---- 3. boot, and check from the host after each import ---------------------------
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
started=$(date +%s.%N)
qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2048 \
    -drive "file=$work/disk.img,format=raw,if=virtio" \
    -nic "user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:$port-:8000" \
    -display none -monitor none -serial "file:$work/serial.log" -no-reboot &
qemu_pid=$!
say "booting $(basename "$IMAGE") under TCG, guest port 8000 on 127.0.0.1:$port"
elapsed() { echo "$(date +%s.%N) - $started" | bc; }
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v2/health/ready', timeout=5)" 2>/dev/null; do
    kill -0 "$qemu_pid" 2>/dev/null || { say "qemu exited"; tail -40 "$work/serial.log"; exit 1; }
    if [ "$(echo "$(elapsed) > $BOOT_TIMEOUT" | bc)" = 1 ]; then
        say "not ready after ${BOOT_TIMEOUT}s"; tail -40 "$work/serial.log"; exit 1
    fi
    sleep 0.5
done
ready_s=$(elapsed)
say "ready ${ready_s}s after power-on"

# STEP: wait for the guest's report of a step (a JSON line), bounded
step() {
    local name=$1 end=$(( $(date +%s) + STEP_TIMEOUT + 600 )) line
    while [ "$(date +%s)" -lt "$end" ]; do
        line=$(grep -a "UPDATE-TEST {.*\"step\": \"$name\"" "$work/serial.log" | tr -d '\r' | tail -1 || true)
        if [ -n "$line" ]; then echo "${line#*UPDATE-TEST }"; return 0; fi
        if grep -aq 'UPDATE-TEST {.*"step": "error"' "$work/serial.log"; then
            grep -a 'UPDATE-TEST' "$work/serial.log" | tr -d '\r' | sed 's/^.*UPDATE-TEST /guest: /'
            say "the guest reported an error"; return 1
        fi
        kill -0 "$qemu_pid" 2>/dev/null || { tail -40 "$work/serial.log"; say "qemu exited"; return 1; }
        sleep 2
    done
    tail -40 "$work/serial.log"; say "no '$name' from the guest within the timeout"; return 1
}
# FIELD JSON EXPR: EXPR evaluated over the JSON object's keys
field() { python3 -c 'import json, sys; print(eval(sys.argv[2], {"json": json}, json.loads(sys.argv[1])))' "$1" "$2"; }
# the host's view: the version /v2 reports, READY, each model READY, a demo inference
host_check() {
    python3 - "$port" "$1" "$2" <<'EOF'
import json
import sys
import urllib.request

port, version, models = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
base = f"http://127.0.0.1:{port}"
meta = json.load(urllib.request.urlopen(f"{base}/v2", timeout=30))
assert meta["version"] == version, (meta["version"], version)
assert urllib.request.urlopen(f"{base}/v2/health/ready", timeout=30).status == 200
for m in models:
    assert urllib.request.urlopen(f"{base}/v2/models/{m}/ready", timeout=30).status == 200, m
request = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
    ]
}
req = urllib.request.Request(f"{base}/v2/models/simple/infer", data=json.dumps(request).encode())
out = next(o for o in json.load(urllib.request.urlopen(req, timeout=60))["outputs"]
           if o["name"] == "OUTPUT0")
assert out["data"] == [x + 1 for x in range(16)], out
print(f"update-test: host sees version {meta['version']}, READY, {len(models)} models READY, "
      "demo inference ok")
EOF
}

before=$(step before)
say "guest before: $before"
models=$(field "$before" 'json.dumps(models)')
[ "$(field "$before" version)" = "$committed" ] || { say "the image serves $(field "$before" version), not $committed"; exit 1; }
say "agent unit: $(step agent-start)"

good_line=$(step good.export-imported)
say "guest after the good import: $good_line"
[ "$(field "$good_line" rc)" = 0 ] || { say "the import failed"; exit 1; }
[ "$(field "$good_line" committed)" = "$good" ] || { say "$good was not committed"; exit 1; }
[ "$(field "$good_line" version)" = "$good" ] || { say "the server does not answer as $good"; exit 1; }
[ "$(field "$good_line" 'models == '"$models")" = True ] || { say "not the same models READY"; exit 1; }
host_check "$good" "$models"
good_s=$(field "$good_line" seconds)
say "agent after the update: $(step good.export-status)"

bad_line=$(step bad.export-imported)
say "guest after the bad import: $bad_line"
[ "$(field "$bad_line" rc)" = 1 ] || { say "the bad import did not fail"; exit 1; }
[ "$(field "$bad_line" committed)" = "$good" ] || { say "$good is not the committed one"; exit 1; }
[ "$(field "$bad_line" "'$bad' in bad")" = True ] || { say "$bad is not marked bad"; exit 1; }
[ "$(field "$bad_line" "last['result']")" = rolled_back ] || { say "$bad was not rolled back"; exit 1; }
[ "$(field "$bad_line" version)" = "$good" ] || { say "the server does not answer as $good"; exit 1; }
[ "$(field "$bad_line" 'models == '"$models")" = True ] || { say "not the same models READY"; exit 1; }
host_check "$good" "$models"
bad_s=$(field "$bad_line" seconds)
say "agent after the rollback: $(step bad.export-status)"

step done >/dev/null
for _ in $(seq 300); do
    kill -0 "$qemu_pid" 2>/dev/null || break
    sleep 1
done
if kill -0 "$qemu_pid" 2>/dev/null; then
    say "the guest did not power off"; tail -40 "$work/serial.log"; exit 1
fi
wait "$qemu_pid" || true
qemu_pid=""
total_s=$(elapsed)
# the guest's own report (steps, agent units, the imports' log), for the record
grep -a 'UPDATE-TEST' "$work/serial.log" | tr -d '\r' | sed 's/^.*UPDATE-TEST /guest: /' | cut -c1-400
say "PASS  ready ${ready_s}s after power-on; import to committed ($committed -> $good) ${good_s}s;" \
    "bad release to rolled back ($bad -> $good) ${bad_s}s; powered off after ${total_s}s (TCG)"
