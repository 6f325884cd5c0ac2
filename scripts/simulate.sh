#!/usr/bin/env bash
# Install PrivFusion (with the 'plots' extra: the report's figures) into .venv, then run the main
# job: four simulated hospitals, each a real peer daemon on loopback, fusing their models
# (privfusion simulate, bundled hospitals.toml).
# The report lands in runs/hospitals (a new directory each time: runs/hospitals-2, -3, ...).
# Extra arguments go to the command (e.g. a scenario file, or --scenario digits.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[plots]'
out=runs/hospitals
n=1
while [ -e "$out" ]; do n=$((n + 1)); out="runs/hospitals-$n"; done
exec .venv/bin/privfusion simulate --out "$out" "$@"
