#!/usr/bin/env bash
# Install PrivFusion with its test dependencies (the 'test' extra, which holds the 'plots' and
# 'dev' ones too) into .venv, check lint and formatting (ruff, configured in pyproject.toml),
# then run the whole test suite, slow end-to-end tests included. Extra arguments go to pytest
# (e.g. -m "not slow", -k ledger; -n 0 runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
# The several-hosts test puts sites in network namespaces (ip netns, as root): install iproute2
# when it is missing and we may (CI runs as root); elsewhere that test skips and says why.
if ! command -v ip > /dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 > /dev/null
fi
# The audit report's test renders the page in headless Chromium (tests/test_ledger_report.py):
# install Debian's chromium the same way; elsewhere that test skips and says why (under CI it fails).
if ! command -v chromium > /dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
fi
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
# lint before the tests: a finding fails the script (set -e) before any test runs
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The image and the compose demo, end to end (scripts/docker_e2e.sh: engine, base image, build,
# compose up, health, the documented round, every ledger against its receipts, down): under CI
# (CI=true), or when asked with PRIVFUSION_DOCKER_E2E=1; it needs root and Debian's packages.
# It runs before the tests so that pytest's closing line is the last of the run. OFFLINE=1: this
# machine sends nothing to a registry, so the base image is made locally (and cached).
case "${PRIVFUSION_DOCKER_E2E:-${CI:-0}}" in
    1 | true) OFFLINE="${OFFLINE:-1}" ./scripts/docker_e2e.sh ;;
    *) echo "scripts/test.sh: the docker end-to-end (scripts/docker_e2e.sh) runs under CI=true or PRIVFUSION_DOCKER_E2E=1" ;;
esac
# Two worker processes (pytest-xdist), a test file per worker at a time (--dist loadfile: a file's
# module fixtures are built once): most tests wait on subprocesses, daemons and sockets, so one
# process keeps about 1.1 of CI's 2 cores busy; two finish the suite in about two thirds of the time.
# Each worker runs torch on its share of the cores (one thread each on CI's 2), and the commands
# and daemons its tests start inherit that (tests/conftest.py): two workers of two spinning OpenMP
# threads each on 2 cores spent about twice the CPU on the same tests.
# --durations: the slowest tests are listed at the end of every run (CI logs say where time goes)
exec .venv/bin/python -m pytest --run-slow -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
