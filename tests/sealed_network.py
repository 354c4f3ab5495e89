"""A network with nothing outside it, for the tests that prove nothing leaves the device.

:func:`run` (as root) runs a command in a fresh network and mount namespace whose only
interface is loopback (``unshare --net --mount`` starting this file with ``--inside``,
which refuses to run in the namespaces of the process that started it). Inside it,
and only there, ``/etc/resolv.conf`` names a DNS recorder on 127.0.0.1:53,
``/etc/hosts`` knows only ``localhost`` and ``nsswitch.conf`` resolves host names from
those two files alone, so every host name a program looks up reaches the recorder,
which answers NXDOMAIN and writes the query to ``OUT/dns.jsonl``. :func:`traced` wraps
a command in ``strace -f`` so that every socket address a process and its children
connect or send to is written down; :func:`outside_addresses` lists those that are
not loopback. A connection that cannot leave still shows there: strace records the
attempt, whatever it returned.

From a shell (docs/security.md uses it for its evidence)::

    sudo python3 tests/sealed_network.py OUT -- COMMAND...

runs COMMAND traced in a sealed network and prints the names it looked up and the
outside addresses it tried.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# the variables ONNX Runtime and OpenVINO's telemetry read to decide they run in CI (and
# then stay silent): a test that proves the appliance itself is silent removes them
CI_VARIABLES = (
    "CI",
    "TF_BUILD",
    "GITHUB_ACTIONS",
    "GITLAB_CI",
    "CIRCLECI",
    "TRAVIS",
    "JENKINS_URL",
    "CODEBUILD_BUILD_ID",
    "BUILDKITE",
    "TEAMCITY_VERSION",
    "APPVEYOR",
    "BITBUCKET_BUILD_NUMBER",
    "SYSTEM_TEAMFOUNDATIONCOLLECTIONURI",
)

_SYSCALLS = "trace=connect,sendto,sendmsg,sendmmsg"


def unavailable() -> str | None:
    """Why a sealed network cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (unshare --net, bind mounts, port 53)"
    for tool in ("unshare", "mount", "strace"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/test.sh installs it on Debian)"
    for name in ("resolv.conf", "hosts", "nsswitch.conf"):
        if not Path("/etc", name).exists():  # a bind mount needs something to cover
            return f"needs /etc/{name}"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--propagation", "private", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN, say
        return f"cannot make namespaces here: {probe.stderr.strip()}"
    return None


def run(
    out: Path, command: list[str], *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a sealed network; its DNS queries go to ``out/dns.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [
            *("unshare", "--net", "--mount", "--propagation", "private", "--"),
            *(sys.executable, str(Path(__file__).resolve()), "--inside", str(out)),
            *("--", *command),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def queries(out: Path) -> list[dict[str, Any]]:
    """The DNS queries the recorder received: {"t", "name", "type"} each."""
    path = out / "dns.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def traced(command: list[str], log: Path) -> list[str]:
    """``command`` under strace: every connect/send with an address, children included.

    seccomp-bpf stops only the four traced system calls, so the traced process runs
    at near full speed everywhere else."""
    return [
        *("strace", "-f", "--seccomp-bpf", "-qq", "-v", "-s", "0", "-e", _SYSCALLS),
        *("-e", "signal=none", "-o", str(log), *command),
    ]


_INET = re.compile(r'sa_family=AF_INET, sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)')
_INET6 = re.compile(
    r'sa_family=AF_INET6, sin6_port=htons\((\d+)\),.*?inet_pton\(AF_INET6, "([^"]+)"'
)


def _loopback(address: str) -> bool:
    if address.startswith("::ffff:"):
        address = address[len("::ffff:") :]
    return address.startswith("127.") or address == "::1"


def addresses(log: Path) -> list[str]:
    """Every IPv4/IPv6 ``address:port`` in a :func:`traced` log, in order."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        for pattern in (_INET, _INET6):
            for port, address in pattern.findall(line):
                found.append(f"{address}:{port}")
    return found


def outside_addresses(log: Path) -> list[str]:
    """The addresses in a :func:`traced` log that are not loopback."""
    return [a for a in addresses(log) if not _loopback(a.rsplit(":", 1)[0])]


# ---- inside the namespace -------------------------------------------------------------


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _cover(path: str, text: str, out: Path) -> None:
    """Bind a file with ``text`` over ``path`` (this mount namespace only)."""
    replacement = out / ("etc-" + Path(path).name)
    replacement.write_text(text)
    subprocess.run(["mount", "--bind", str(replacement), path], check=True)


def _seal(out: Path) -> None:
    _loopback_up()
    nsswitch = [
        line
        for line in Path("/etc/nsswitch.conf").read_text().splitlines()
        if not line.startswith("hosts:")
    ]
    _cover("/etc/nsswitch.conf", "\n".join([*nsswitch, "hosts: files dns"]) + "\n", out)
    _cover("/etc/hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost\n", out)
    _cover("/etc/resolv.conf", "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n", out)
    # nscd's socket would resolve names outside the namespace: hide it
    for cache in sorted({os.path.realpath(p) for p in ("/run/nscd", "/var/run/nscd")}):
        if Path(cache).is_dir():
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", cache], check=True)


class _Recorder:
    """A DNS server on 127.0.0.1:53 (UDP and TCP) that writes down every query and
    answers each with NXDOMAIN."""

    def __init__(self, path: Path) -> None:
        self._log = path.open("a", buffering=1)
        self._lock = threading.Lock()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 53))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("127.0.0.1", 53))
        self.tcp.listen()
        for target in (self._serve_udp, self._serve_tcp):
            threading.Thread(target=target, daemon=True).start()

    def _answer(self, query: bytes) -> bytes | None:
        if len(query) < 17:
            return None
        labels, i = [], 12
        while i < len(query) and query[i]:
            n = query[i]
            labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        if i + 5 > len(query):
            return None
        qtype = struct.unpack("!H", query[i + 1 : i + 3])[0]
        record = {"t": round(time.time(), 3), "name": ".".join(labels) + ".", "type": qtype}
        with self._lock:
            self._log.write(json.dumps(record) + "\n")
        # the question echoed back: response, recursion desired and available, NXDOMAIN
        return query[:2] + struct.pack("!HHHHH", 0x8183, 1, 0, 0, 0) + query[12 : i + 5]

    def _serve_udp(self) -> None:
        while True:
            query, peer = self.udp.recvfrom(4096)
            answer = self._answer(query)
            if answer is not None:
                self.udp.sendto(answer, peer)

    def _serve_tcp(self) -> None:
        while True:
            conn, _ = self.tcp.accept()
            with conn:
                conn.settimeout(5)
                try:
                    size = struct.unpack("!H", conn.recv(2))[0]
                    answer = self._answer(conn.recv(size))
                    if answer is not None:
                        conn.sendall(struct.pack("!H", len(answer)) + answer)
                except (OSError, struct.error):
                    pass


def _in_own_namespaces() -> bool:
    """True in network and mount namespaces other than those of the process that
    started this script (``unshare`` made them and became this script): the bind
    mounts of :func:`_seal` must never cover the host's own files."""
    try:
        return all(
            os.readlink(f"/proc/self/ns/{ns}") != os.readlink(f"/proc/{os.getppid()}/ns/{ns}")
            for ns in ("net", "mnt")
        )
    except OSError:
        return False


def _inside(argv: list[str]) -> int:
    if not _in_own_namespaces():
        print("sealed_network: --inside is for run() (unshare --net --mount)", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[argv.index("--") + 1 :]
    out.mkdir(parents=True, exist_ok=True)
    _seal(out)
    _Recorder(out / "dns.jsonl")
    return subprocess.run(command).returncode


def main(argv: list[str]) -> int:
    if argv[:1] == ["--inside"]:
        return _inside(argv[1:])
    out, command = Path(argv[0]), argv[argv.index("--") + 1 :]
    out.mkdir(parents=True, exist_ok=True)
    log = out / "trace.log"
    done = run(out, traced(command, log), timeout=3600)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    names = [f"{q['name']} (type {q['type']})" for q in queries(out)]
    print(f"sealed_network: exit {done.returncode}; {len(names)} DNS quer(ies)", *names, sep="\n  ")
    outside = outside_addresses(log)
    print(f"sealed_network: {len(outside)} address(es) outside loopback", *outside, sep="\n  ")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
