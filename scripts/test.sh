#!/usr/bin/env bash
# Install what the tests need (the package with its `test` extra), then run every
# check: ruff, mypy and the whole pytest suite. This is the README's test command.
#
# Nothing is written into the checkout, so it may be read-only: the package is built
# from a copy in a temporary directory (setuptools would put egg-info and build/ next
# to the sources), and caches go to that directory too. The tests import the checkout
# itself (python3 -m puts the current directory first on sys.path); the install brings
# the dependencies and the `appliance` command.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tar --exclude=.git --exclude='*.egg-info' --exclude=build --exclude=__pycache__ -cf - . \
    | tar -xf - -C "$scratch"
constraints=()
[ -f constraints.txt ] && constraints=(-c constraints.txt)
python3 -m pip install --quiet --disable-pip-version-check "${constraints[@]}" "$scratch[test]"
export PYTHONPYCACHEPREFIX="$scratch/pycache"
# the MQTT tests run a real broker: Debian's mosquitto (installed to /usr/sbin, which a
# non-login PATH may lack; tests/mosquitto.py looks there too); tests/test_no_egress.py
# traces the server with strace in a sealed network namespace (unshare and mount come
# with util-linux); the OTA clock tests run the agent under Debian's libfaketime
missing=()
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then missing+=(mosquitto); fi
if ! command -v strace >/dev/null; then missing+=(strace); fi
if ! compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null; then missing+=(faketime); fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "test.sh: ${missing[*]} not installed; the tests that need them will be skipped" >&2
    fi
fi
python3 -m ruff check --no-cache appliance backends ota devtools tests benchmarks
python3 -m mypy --cache-dir "$scratch/mypy"
python3 -m pytest -q -p no:cacheprovider
