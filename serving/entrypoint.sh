#!/usr/bin/env bash
# Serving entrypoint: refuse to start vLLM on a model the trainer has not finished writing,
# then hand over to `vllm serve` with the arguments unchanged (serving/vllm_args.py renders them).
#
#   entrypoint.sh /mnt/models/merged --served-model-name gemma --port 8000
#   entrypoint.sh /mnt/models/base --enable-lora --lora-modules emoji=/mnt/models/adapter
#
# "Complete" has one definition, serving/completion.py (copied next to this script in the
# image): the trainer's marker, its inventory of file names and sizes, and every listed file
# readable by this user (the image runs as uid 10001). Starting vLLM on anything less would
# serve, or crash minutes later on, half-written or unreadable weights; exiting non-zero makes
# Cloud Run keep the previous revision and show the reason in the revision's logs.
#
# Environment:
#   GEMMA_FT_WAIT_FOR_MODEL_S   seconds to wait for the marker before giving up (default 0).
#   GEMMA_FT_STARTUP_WINDOW_S   the platform's startup window (the Cloud Run service sets it from
#                               serving/startup.py); the marker wait is spent inside it, so a wait
#                               that leaves vLLM no time is refused here instead of timing out later.
#   GEMMA_FT_SKIP_MODEL_CHECK   set to 1 to serve a folder without the check (not recommended).
set -euo pipefail

# Must equal trainer.export.COMPLETION_MARKER (tests/serving/test_marker_contract.py).
COMPLETION_MARKER="_COMPLETE.json"
WAIT_S="${GEMMA_FT_WAIT_FOR_MODEL_S:-0}"
WINDOW_S="${GEMMA_FT_STARTUP_WINDOW_S:-}"
HERE="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
CHECK="$HERE/completion.py"

log() { echo "entrypoint: $*" >&2; }
die() {
  log "ERROR: $*"
  exit 3
}

if ! [[ "$WAIT_S" =~ ^[0-9]+$ ]]; then
  die "GEMMA_FT_WAIT_FOR_MODEL_S=$WAIT_S is not a whole number of seconds"
fi
if [[ -n "$WINDOW_S" ]]; then
  if ! [[ "$WINDOW_S" =~ ^[0-9]+$ ]]; then
    die "GEMMA_FT_STARTUP_WINDOW_S=$WINDOW_S is not a whole number of seconds"
  fi
  if ((WAIT_S >= WINDOW_S)); then
    die "GEMMA_FT_WAIT_FOR_MODEL_S=$WAIT_S leaves vLLM no time within the ${WINDOW_S} s startup window; lower it (serving/startup.py)"
  fi
  log "startup window ${WINDOW_S} s: up to ${WAIT_S} s waiting for $COMPLETION_MARKER, the rest for vLLM"
fi

if [[ "${GEMMA_FT_SKIP_MODEL_CHECK:-0}" == "1" ]]; then
  log "GEMMA_FT_SKIP_MODEL_CHECK=1: serving without checking for $COMPLETION_MARKER"
else
  if [[ ! -f "$CHECK" ]]; then
    die "$CHECK is missing: the image must contain serving/completion.py next to this script"
  fi
  "${PYTHON:-python3}" "$CHECK" --wait-s "$WAIT_S" --vllm-args "$@" || exit 3
fi

exec vllm serve "$@"
