#!/usr/bin/env bash
# Install what the tests need (the package with its `test` extra), then run every
# check: ruff, mypy and the whole pytest suite. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
# the MQTT tests run a real broker: Debian's mosquitto (installed to /usr/sbin, which a
# non-login PATH may lack; tests/mosquitto.py looks there too)
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null
    else
        echo "test.sh: mosquitto is not installed; the MQTT tests will be skipped" >&2
    fi
fi
python3 -m ruff check appliance backends ota tests benchmarks
python3 -m mypy
python3 -m pytest -q
