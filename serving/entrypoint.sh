#!/usr/bin/env bash
# Serving entrypoint: refuse to start vLLM on a model the trainer has not finished writing,
# then hand over to `vllm serve` with the arguments unchanged (serving/vllm_args.py renders them).
#
#   entrypoint.sh /mnt/models/merged --served-model-name gemma --port 8000
#   entrypoint.sh /mnt/models/base --enable-lora --lora-modules emoji=/mnt/models/adapter
#
# The trainer writes COMPLETION_MARKER as the last file of an export, so a folder without it
# is a run that is still going, failed, or was interrupted. Starting vLLM on it would serve
# (or crash on) half-written weights; exiting non-zero makes Cloud Run keep the previous
# revision and show this message in the revision's logs.
#
# Environment:
#   GEMMA_FT_WAIT_FOR_MODEL_S  seconds to wait for the marker before giving up (default 0).
#                              Keep it under the platform's startup window (Cloud Run: 240 s).
#   GEMMA_FT_SKIP_MODEL_CHECK  set to 1 to serve a folder without the marker (not recommended).
set -euo pipefail

# Must equal trainer.export.COMPLETION_MARKER (tests/serving/test_marker_contract.py).
COMPLETION_MARKER="_COMPLETE.json"
WAIT_S="${GEMMA_FT_WAIT_FOR_MODEL_S:-0}"
HELP="see the training job's logs (gcloud run jobs executions list / kubectl logs) and serving/README.md"

log() { echo "entrypoint: $*" >&2; }
die() {
  log "ERROR: $*"
  exit 3
}

if ! [[ "$WAIT_S" =~ ^[0-9]+$ ]]; then
  die "GEMMA_FT_WAIT_FOR_MODEL_S=$WAIT_S is not a whole number of seconds"
fi

# A local folder (absolute or relative path, or an existing directory) is checked;
# a Hub id such as google/gemma-3-1b-it is downloaded by vLLM and has no marker.
is_local_path() {
  [[ "$1" == /* || "$1" == ./* || "$1" == ../* || -d "$1" ]]
}

# Wait (up to WAIT_S) for the marker, then insist on it.
require_complete() {
  local kind="$1" dir="$2" waited=0
  while [[ ! -f "$dir/$COMPLETION_MARKER" && "$waited" -lt "$WAIT_S" ]]; do
    if ((waited % 30 == 0)); then
      log "waiting for $dir/$COMPLETION_MARKER ($waited/$WAIT_S s)"
    fi
    sleep 5
    waited=$((waited + 5))
  done
  if [[ ! -d "$dir" ]]; then
    die "$kind at $dir does not exist: training has not written it yet, or the bucket is not mounted there; $HELP"
  fi
  if [[ ! -f "$dir/$COMPLETION_MARKER" ]]; then
    die "$kind at $dir is not complete (no $COMPLETION_MARKER): training has not finished or failed; $HELP"
  fi
  log "$kind at $dir is complete"
}

model=""
adapters=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  arg="${args[$i]}"
  case "$arg" in
    --model=*) model="${arg#--model=}" ;;
    --model) model="${args[$((i + 1))]:-}" ;;
    --lora-modules)
      # name=path items (or vLLM's JSON form) follow until the next flag
      while ((i + 1 < ${#args[@]})) && [[ "${args[$((i + 1))]}" != -* ]]; do
        i=$((i + 1))
        item="${args[$i]}"
        if [[ "$item" == \{* ]]; then
          item="$(sed -n 's/.*"path"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p' <<<"$item")"
        else
          item="${item#*=}"
        fi
        [[ -n "$item" ]] && adapters+=("$item")
      done
      ;;
    -*) ;;
    *) if [[ $i -eq 0 ]]; then model="$arg"; fi ;;
  esac
done

if [[ -z "$model" ]]; then
  die "no model given: pass the model folder as the first argument (serving/vllm_args.py renders it)"
fi

if [[ "${GEMMA_FT_SKIP_MODEL_CHECK:-0}" == "1" ]]; then
  log "GEMMA_FT_SKIP_MODEL_CHECK=1: serving without checking for $COMPLETION_MARKER"
else
  if is_local_path "$model"; then
    require_complete "model" "$model"
  else
    log "model $model is not a local folder; vLLM will fetch it (no completion check)"
  fi
  for adapter in "${adapters[@]}"; do
    require_complete "LoRA adapter" "$adapter"
    if [[ ! -f "$adapter/adapter_config.json" ]]; then
      die "LoRA adapter at $adapter has no adapter_config.json: point lora_modules at the adapter folder the trainer exported"
    fi
  done
fi

exec vllm serve "$@"
