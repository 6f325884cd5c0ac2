#!/usr/bin/env bash
# Install PrivFusion into .venv, then run the main job. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
exec .venv/bin/privfusion experiment fusion --dataset digits "$@"
