#!/usr/bin/env bash
# Install PrivFusion with its test dependencies into .venv, then run the whole test suite,
# slow end-to-end tests included. Extra arguments go to pytest (e.g. -m "not slow", -k ledger).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest --run-slow "$@"
