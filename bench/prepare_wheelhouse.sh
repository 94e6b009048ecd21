#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check.sh installs offline on a GPU machine (bench/prepare_wheelhouse.py).
#   bench/prepare_wheelhouse.sh [--dest build/gpu-wheelhouse] [--with-270m] [--plan]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" bench/prepare_wheelhouse.py "$@"
