#!/usr/bin/env bash
# Serving entrypoint: refuse to start vLLM on a model the trainer has not finished writing,
# then hand over to `vllm serve` with the arguments unchanged (serving/vllm_args.py renders them).
#
#   entrypoint.sh /mnt/models/merged --served-model-name gemma --port 8000
#   entrypoint.sh /mnt/models/base --enable-lora --lora-modules emoji=/mnt/models/adapter
#
# "Complete" has one definition, serving/completion.py (copied next to this script in the
# image): the trainer's marker, its inventory of file names and sizes, and every listed file
# readable by this user (the image runs as the base image's vllm user, uid 2000, gid 0). Starting vLLM on anything less would
# serve, or crash minutes later on, half-written or unreadable weights; exiting non-zero makes
# Cloud Run keep the previous revision and show the reason in the revision's logs.
#
# Environment:
#   GEMMA_FT_WAIT_FOR_MODEL_S   seconds to wait for the marker before giving up (default 0): for
#                               serving a folder by hand while the trainer finishes it. The Cloud Run
#                               service sets 0 (`pulumi up` serves only a run whose marker it listed).
#   GEMMA_FT_STARTUP_WINDOW_S   the platform's startup window, and
#   GEMMA_FT_MAX_MARKER_WAIT_S  the longest wait that window allows (vLLM keeps the rest). The Cloud Run
#                               service sets both from serving/startup.py, the one place the rule lives;
#                               a longer wait is refused here instead of timing out later.
#   GEMMA_FT_SKIP_MODEL_CHECK   set to 1 to serve a folder without the check (not recommended).
#   VLLM_API_KEY                when non-empty, the args must load the API key guard
#                               (`--middleware serving.api_key_guard.ApiKeyGuard`): vLLM alone checks the
#                               key only under /v1, /v2, /inference and /cohere, so a hand `docker run`
#                               without it would serve /invocations unguarded. It is refused, not added,
#                               so the command that starts the server says what it runs.
#
# Every `--middleware` is imported with python3 before vLLM starts: vLLM imports it only in
# build_app, after the engine has loaded the model (minutes on a GPU), so an image without the
# guard would otherwise fail late, or on Cloud Run after the startup window was spent.
# `python3` (or $PYTHON) must be the interpreter `vllm` runs on; in the vllm/vllm-openai base image vLLM is
# installed into the system python3 (UNCONFIRMED for every tag; a wrong one fails here, loudly, not silently).
set -euo pipefail

# Must equal trainer.export.COMPLETION_MARKER (tests/serving/test_marker_contract.py).
COMPLETION_MARKER="_COMPLETE.json"
WAIT_S="${GEMMA_FT_WAIT_FOR_MODEL_S:-0}"
WINDOW_S="${GEMMA_FT_STARTUP_WINDOW_S:-}"
MAX_WAIT_S="${GEMMA_FT_MAX_MARKER_WAIT_S:-}"
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
if [[ -n "$MAX_WAIT_S" ]]; then
  if ! [[ "$MAX_WAIT_S" =~ ^[0-9]+$ ]]; then
    die "GEMMA_FT_MAX_MARKER_WAIT_S=$MAX_WAIT_S is not a whole number of seconds"
  fi
  if ((WAIT_S > MAX_WAIT_S)); then
    die "GEMMA_FT_WAIT_FOR_MODEL_S=$WAIT_S is longer than the ${MAX_WAIT_S} s the startup window${WINDOW_S:+ of ${WINDOW_S} s} allows for it (vLLM needs the rest; serving/startup.py); lower it"
  fi
fi
if [[ -n "$WINDOW_S" ]]; then
  if ! [[ "$WINDOW_S" =~ ^[0-9]+$ ]]; then
    die "GEMMA_FT_STARTUP_WINDOW_S=$WINDOW_S is not a whole number of seconds"
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

# Must equal serving.vllm_args.API_KEY_GUARD_MIDDLEWARE (tests/serving/test_entrypoint.py runs both).
GUARD="serving.api_key_guard.ApiKeyGuard"
middlewares=()
prev=""
for arg in "$@"; do
  if [[ "$prev" == "--middleware" ]]; then
    middlewares+=("$arg")
  elif [[ "$arg" == --middleware=* ]]; then
    middlewares+=("${arg#--middleware=}")
  fi
  prev="$arg"
done
if [[ -n "${VLLM_API_KEY:-}" ]]; then
  guarded=0
  for mw in "${middlewares[@]}"; do
    [[ "$mw" == "$GUARD" ]] && guarded=1
  done
  if ((guarded == 0)); then
    die "VLLM_API_KEY is set but the args do not load the API key guard: vLLM alone checks the key only under /v1, /v2, /inference and /cohere and would serve /invocations without it. Add: --middleware $GUARD"
  fi
fi
for mw in "${middlewares[@]}"; do
  # the import vLLM's build_app does: module path, then the attribute (vllm/entrypoints/openai/api_server.py)
  if ! why="$("${PYTHON:-python3}" -c 'import importlib, sys
module, _, name = sys.argv[1].rpartition(".")
getattr(importlib.import_module(module), name)' "$mw" 2>&1)"; then
    die "--middleware $mw cannot be imported (${why##*$'\n'}); vLLM would fail only after loading the model. Build the image from serving/Dockerfile, which copies serving/api_key_guard.py under /opt/gemma-serving and puts it on PYTHONPATH"
  fi
done

# A base streamed from gs:// (--load-format runai_streamer) needs the streamer and its GCS backend
# (serving/Dockerfile installs it): checked now, not after vLLM has started its engine.
for arg in "$@"; do
  if [[ "$arg" == "runai_streamer" || "$arg" == "--load-format=runai_streamer" ]]; then
    if ! why="$("${PYTHON:-python3}" -c 'import runai_model_streamer, runai_model_streamer_gcs' 2>&1)"; then
      die "--load-format runai_streamer, but the Run:ai streamer cannot be imported (${why##*$'\n'}): build the image from serving/Dockerfile, which installs runai-model-streamer-gcs"
    fi
  fi
done

exec vllm serve "$@"
