#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): each recipe's first steps on CUDA, results to a file.
#
#   bench/prepare_wheelhouse.sh               # here, with PyPI: the wheels the GPU machine lacks (one carry)
#   bench/gpu_check.sh [--only a,b] [--out F] # there: installs them offline, probes, runs the checks (~480 s)
#   bench/gpu_check.sh --probe-only           # there: the install and the probe only (seconds)
#   bench/gpu_check.sh --dry-run --out F.json # on a CPU: the same plan with tiny models (plumbing only)
#
# The GPU machine's python3 is itself a venv with torch, transformers, accelerate, ... and no network. The
# wheels in $WHEELHOUSE go into their own folder ($GPU_SITE) with `pip install --no-index --no-deps --target`,
# which is put first on PYTHONPATH: every process the check starts (its workers, trainer/launch.py's
# `accelerate launch`, torchrun's ranks) inherits it. No `venv --system-site-packages`: made from a venv's
# interpreter, it links the base Python (CPython Lib/venv/__init__.py writes `home` from sys._base_executable),
# so it would not see the machine's torch. Then bench/prepare_wheelhouse.py --probe checks the versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELHOUSE=${WHEELHOUSE:-build/gpu-wheelhouse}
SITE=${GPU_SITE:-/tmp/gpu-site}
probe_only=false
hard_stop=560  # the 480 s budget, the models' preparation and a margin: under the device call's timeout_s (590)
args=()
for arg in "$@"; do
  if [ "$arg" = --probe-only ]; then probe_only=true; else args+=("$arg"); fi
  if [ "$arg" = --dry-run ]; then hard_stop=960; fi  # a CPU has no lease: its 900 s budget
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
site_arg=()
if [ -f "$WHEELHOUSE/requirements.txt" ] && ! "$PY" bench/prepare_wheelhouse.py --missing "$WHEELHOUSE"; then
  shopt -s nullglob
  wheels=("$WHEELHOUSE"/*.whl "$WHEELHOUSE"/part-*/*.whl)
  shopt -u nullglob
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --disable-pip-version-check \
    --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE:$PYTHONPATH"
  site_arg=(--site "$SITE")
elif ! "$PY" -c "import trl, datasets" 2>/dev/null; then
  echo "error: trl/datasets are not installed and $WHEELHOUSE has no wheels (run bench/prepare_wheelhouse.sh here, carry $WHEELHOUSE)" >&2
  exit 2
fi
if [ ${#site_arg[@]} -gt 0 ]; then  # installed just now: check it (a CPU venv that has the pins skips both)
  "$PY" bench/prepare_wheelhouse.py --probe "$WHEELHOUSE" "${site_arg[@]}"
fi
if $probe_only; then exit 0; fi
# the driver keeps its own budget (--budget-s: 480 s, 900 s with --dry-run); this is the hard stop
exec timeout "${GPU_CHECK_HARD_STOP_S:-$hard_stop}" "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"}  # bash < 4.4: set -u
