#!/usr/bin/env bash
# Install what the tests need (the package with its `test` extra), then run every
# check: ruff, mypy and the whole pytest suite. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
python3 -m ruff check appliance backends tests benchmarks
python3 -m mypy
python3 -m pytest -q
