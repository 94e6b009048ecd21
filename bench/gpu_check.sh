#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): each recipe's first steps on CUDA, results to a file.
#
#   bench/prepare_wheelhouse.sh               # here, with PyPI: the wheels the GPU machine lacks
#   bench/gpu_check.sh [--out FILE]            # there: installs them offline, runs the checks (< 10 min)
#   bench/gpu_check.sh --dry-run --out F.json  # on a CPU: the same plan with tiny models (plumbing only)
#
# The GPU machine has torch, triton, transformers, peft and accelerate but no network: when trl or
# datasets is missing, the wheels in $WHEELHOUSE (default build/gpu-wheelhouse) go into a venv that
# sees the system's packages (--system-site-packages), installed with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELHOUSE=${WHEELHOUSE:-build/gpu-wheelhouse}
if ! "$PY" -c "import trl, datasets" 2>/dev/null; then
  if [ ! -f "$WHEELHOUSE/requirements.txt" ]; then
    echo "error: trl/datasets are not installed and $WHEELHOUSE has no wheels (run bench/prepare_wheelhouse.sh)" >&2
    exit 2
  fi
  venv=build/gpu-check-venv
  "$PY" -m venv --system-site-packages "$venv"
  links=(--find-links "$WHEELHOUSE")
  for part in "$WHEELHOUSE"/part-*; do [ -d "$part" ] && links+=(--find-links "$part"); done
  "$venv/bin/python" -m pip install --quiet --no-index "${links[@]}" -r "$WHEELHOUSE/requirements.txt"
  PY=$venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# the driver keeps its own 540 s budget; this is the hard stop
exec timeout 590 "$PY" bench/gpu_check.py "$@"
