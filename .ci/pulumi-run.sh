#!/usr/bin/env bash
# One Pulumi command on one stack, as the CI workflows run it (preview.yml, deploy.yml):
#   .ci/pulumi-run.sh preview STACK           # PR previews and the deploy's preview (reads state only)
#   .ci/pulumi-run.sh preview-destroy STACK   # what `destroy` would delete (the bucket backend locks for it)
#   .ci/pulumi-run.sh up STACK | destroy STACK
#   .ci/pulumi-run.sh cancel STACK            # release the lock of a run that was killed
#
# Environment: PULUMI_BACKEND_URL (gs://… bucket backend) or PULUMI_ACCESS_TOKEN (Pulumi Cloud, then PULUMI_ORG
# names the organisation); GCP_PROJECT_ID (bucket backend: the stack's KMS key is checked); PULUMI_REVIEWED_PLAN
# (`up`/`destroy`: the digest of the reviewed preview); PULUMI_BUDGET / PULUMI_GRACE bound `up` and `destroy`
# (240m / 60m); PULUMI_CANCEL_WAIT (s, default 180, at most 200) bounds how long `cancel` waits for an
# interrupted run; PULUMI_LOG (default $RUNNER_TEMP/pulumi.log). Writes exit-code, log and plan-digest to
# $GITHUB_OUTPUT for the report step (.ci/preview_report.py).
#
# Decisions (the evidence: docs/ci.md#one-sigint-then-the-lock)
# - The stack is selected, never created; a stack file not on its own KMS key stops before Pulumi runs.
# - `up`/`destroy` with PULUMI_REVIEWED_PLAN preview again and run only if the digest is the reviewed one.
# - `up`/`destroy` run under `timeout --foreground --signal=INT`, in a session of their own: past the budget,
#   or on the first SIGINT/SIGTERM to this script (a cancelled job, Ctrl-C), Pulumi gets exactly one SIGINT
#   and cancels at a safe point (a second one would terminate it at once); past the grace it is killed with
#   its session and `pulumi cancel` releases the lock. `cancel` waits for an interrupted run first.
# - Every preview and `up` runs with the policy pack; no colour, so the report quotes violations verbatim.
set -euo pipefail

usage="usage: $0 preview|preview-destroy|up|destroy|cancel STACK"
command="${1:?$usage}"
stack="${2:?$usage}"
if [[ ! "$command" =~ ^(preview|preview-destroy|up|destroy|cancel)$ ]]; then
  echo "$usage" >&2
  exit 2
fi
if [[ ! "$stack" =~ ^[A-Za-z0-9_.-]+$ ]]; then
  echo "error: stack name '$stack' may only hold letters, digits, '_', '.' and '-'" >&2
  exit 2
fi
budget="${PULUMI_BUDGET:-240m}"
grace="${PULUMI_GRACE:-60m}"
log="${PULUMI_LOG:-${RUNNER_TEMP:-/tmp}/pulumi.log}"
pidfile="${RUNNER_TEMP:-/tmp}/pulumi-run.pid" # a running `up`/`destroy`: its session id and log, for `cancel`
events="${RUNNER_TEMP:-/tmp}/pulumi-events.jsonl" # a preview's engine event log (.ci/plan_digest.py)
# the runner kills a cancelled job 285 s after the cancel; login and `pulumi cancel` take ~25 s of that
cancel_wait="${PULUMI_CANCEL_WAIT:-180}"
if [[ ! "$cancel_wait" =~ ^[0-9]{1,6}$ ]] || ((10#$cancel_wait > 200)); then
  cancel_wait=200
fi
cancel_wait=$((10#$cancel_wait)) # "09" is nine seconds, not an octal error
qualified="$stack"
if [[ -n "${PULUMI_ORG:-}" ]]; then
  qualified="${PULUMI_ORG}/gemma-finetune/${stack}"
fi
# bucket backend: the stack's own key gft-STACK, in any location and key ring of the project (ci-setup.sh's
# KMS_LOCATION / KMS_KEYRING); the hints name the setup's defaults
provider="" provider_pattern=""
if [[ -n "${PULUMI_BACKEND_URL:-}" && -n "${GCP_PROJECT_ID:-}" ]]; then
  provider="gcpkms://projects/$GCP_PROJECT_ID/locations/global/keyRings/gft-pulumi/cryptoKeys/gft-$stack"
  provider_pattern="^gcpkms://projects/${GCP_PROJECT_ID//./\\.}/locations/[a-z0-9-]+/keyRings/[A-Za-z0-9_-]+/cryptoKeys/gft-${stack//./\\.}\$"
fi
policy=(--policy-pack infra/policy)
common=(--stack "$qualified" --color never --non-interactive)
case "$command" in
  preview | up) check=(preview "${common[@]}" --diff "${policy[@]}" --event-log "$events") ;;
  *) check=(destroy "${common[@]}" --preview-only --event-log "$events") ;;
esac

# whether a process of session $1 is alive; a zombie is not (awk reads all of ps's output: no SIGPIPE)
session_alive() { ps -o stat= -s "$1" 2>/dev/null | awk '$1 !~ /^Z/ { alive = 1 } END { exit !alive }'; }

# `up`/`destroy`: signals are counted from the start (one during login or stack select ends the script
# before Pulumi starts); the first is handed to `timeout` as one SIGINT once timeout has started Pulumi
# (before that, timeout may not have its handlers yet). Test and set are one arithmetic command, so a trap
# that runs in between cannot send a second.
signals=0 forwarded=0 bounded=""
# shellcheck disable=SC2329  # called by the INT/TERM trap and the wait loop
forward_signal() {
  ((signals > 0 && forwarded == 0)) && [[ -n "$bounded" ]] && pgrep -P "$bounded" >/dev/null || return 0
  ((forwarded++ == 0)) || return 0
  kill -INT "$bounded" 2>/dev/null
}
if [[ "$command" == "up" || "$command" == "destroy" ]]; then
  trap 'signals=$((signals + 1)); forward_signal' INT TERM
fi

rc=1 digest=""
# shellcheck disable=SC2329  # called by the EXIT trap
report() {
  if [[ -n "${GITHUB_OUTPUT:-}" ]]; then
    printf 'exit-code=%s\nlog=%s\n' "$rc" "$log" >>"$GITHUB_OUTPUT"
    [[ -z "$digest" ]] || printf 'plan-digest=%s\n' "$digest" >>"$GITHUB_OUTPUT"
  fi
}
plan_digest() { python3 "$(dirname "${BASH_SOURCE[0]}")/plan_digest.py" "$@"; }
trap report EXIT
: >"$log"

pulumi login --non-interactive ${PULUMI_BACKEND_URL:+"$PULUMI_BACKEND_URL"} | tee -a "$log"

if [[ "$command" == "cancel" ]]; then
  set +e
  # an interrupted `up`/`destroy` may still be cancelling: wait for timeout's session (Pulumi's plugins
  # run there in groups of their own), kill it past the wait, then release the lock
  if [[ -s "$pidfile" ]]; then
    read -r sid run_log <"$pidfile"
    if [[ "$sid" =~ ^[0-9]+$ ]] && session_alive "$sid"; then
      echo "pulumi (session $sid) is still finishing: waiting up to ${cancel_wait}s for it" | tee -a "$log"
      for ((waited = 0; waited < cancel_wait; waited++)); do
        session_alive "$sid" || break
        sleep 1
      done
      if session_alive "$sid"; then
        echo "error: still running after ${cancel_wait}s: killing it; run \`pulumi refresh --stack $qualified\`" | tee -a "$log"
        pkill -KILL -s "$sid"
      fi
      if [[ -f "${run_log:-}" ]]; then
        echo "--- the end of the interrupted run's output ($run_log):" | tee -a "$log"
        tail -n 40 "$run_log" | tee -a "$log"
      fi
    fi
    rm -f "$pidfile"
  fi
  pulumi cancel --yes "${common[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  exit "$rc"
fi

if ! selected=$(pulumi stack select "$qualified" --non-interactive 2>&1); then
  {
    echo "$selected"
    echo "error: stack '$qualified' cannot be selected (above). If it does not exist yet, create it once"
    echo "error: (infra/bootstrap/ci-setup.sh does, docs/ci.md \"New stacks\"), commit Pulumi.$stack.yaml, rerun:"
    echo "error:   pulumi stack init $qualified${provider:+ --secrets-provider $provider}"
  } | tee -a "$log"
  rc=3
  exit "$rc"
fi
if [[ -n "$provider" ]]; then
  stack_file="Pulumi.$stack.yaml"
  current=$(sed -n 's/^secretsprovider:[[:space:]]*//p' "$stack_file" 2>/dev/null | head -n 1)
  if grep -q '^encryptionsalt:' "$stack_file" 2>/dev/null; then
    current="a passphrase (encryptionsalt)"
  fi
  if [[ ! "$current" =~ $provider_pattern ]]; then
    {
      echo "error: stack '$stack' is not on its KMS key: $stack_file names ${current:-no secretsprovider}."
      echo "error: CI has no passphrase and each identity decrypts only its stacks' own keys. Move the stack once"
      echo "error: (as someone who can decrypt it now; or rerun infra/bootstrap/ci-setup.sh), commit $stack_file:"
      echo "error:   pulumi stack change-secrets-provider --stack $stack $provider"
    } | tee -a "$log"
    rc=3
    exit "$rc"
  fi
fi

set +e
rm -f "$events"
if [[ "$command" == preview* ]]; then
  PULUMI_DEBUG_COMMANDS=true pulumi "${check[@]}" 2>&1 | tee -a "$log" # it offers --event-log only then
  rc=${PIPESTATUS[0]}
  if ((rc == 0)) && [[ -s "$events" ]]; then
    digest=$(plan_digest "$events")
    echo "plan digest: $digest (deploy.yml's apply job runs this plan or nothing)" | tee -a "$log"
  fi
  exit "$rc"
fi

if [[ -n "${PULUMI_REVIEWED_PLAN:-}" ]]; then
  echo "previewing again: pulumi $command runs only the reviewed plan ($PULUMI_REVIEWED_PLAN)" | tee -a "$log"
  PULUMI_DEBUG_COMMANDS=true pulumi "${check[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if ((rc != 0)); then
    exit "$rc"
  fi
  digest=$(plan_digest "$events")
  if [[ "$digest" != "$PULUMI_REVIEWED_PLAN" ]]; then
    {
      if [[ "$PULUMI_REVIEWED_PLAN" == missing ]]; then
        echo "error: the reviewed preview reported no plan digest, so this plan cannot be matched to it: nothing was changed."
      fi
      echo "error: the plan changed since it was reviewed (reviewed $PULUMI_REVIEWED_PLAN, now $digest): nothing was changed."
      echo "error: the steps now (state, the cloud or what the program reads changed meanwhile):"
      plan_digest --list "$events" | sed 's/^/error:   /'
      echo "error: run deploy.yml again and review the new preview."
    } | tee -a "$log"
    rc=4
    exit "$rc"
  fi
  echo "the plan is the reviewed one ($digest)" | tee -a "$log"
fi
if ((signals > 0)); then
  echo "cancelled before pulumi $command started: nothing was changed" | tee -a "$log"
  rc=130
  exit "$rc"
fi
args=(up "${common[@]}" --yes --diff "${policy[@]}")
if [[ "$command" == "destroy" ]]; then
  args=(destroy "${common[@]}" --yes)
fi
# Pulumi's output goes to the log, which `tail` (started with SIGINT ignored, as every background command
# here) copies onto the console until timeout exits. Each tick hands on a signal not yet handed on: a
# trap runs once the foreground `sleep` ends. Both are done when neither is alive (bash has reaped them).
start=$(($(stat -c %s "$log") + 1))
setsid timeout --foreground --signal=INT --kill-after="$grace" "$budget" pulumi "${args[@]}" >>"$log" 2>&1 &
bounded=$!
echo "$bounded $log" >"$pidfile"
tail -c "+$start" -f --pid="$bounded" "$log" &
follower=$!
while kill -0 "$bounded" 2>/dev/null || kill -0 "$follower" 2>/dev/null; do
  forward_signal
  sleep 0.2
done
wait "$bounded"
rc=$?
rm -f "$pidfile"
if ((rc == 137)); then # killed past its grace: Pulumi's plugins are in timeout's session
  pkill -KILL -s "$bounded" 2>/dev/null
fi
if ((rc == 124 || rc == 137)); then
  {
    echo "error: pulumi $command ran past its budget of $budget and was interrupted (exit $rc)."
    echo "error: releasing any lock it left with \`pulumi cancel\`; then run \`pulumi refresh --stack $qualified\`"
    echo "error: and deploy again (resources created before the interruption are in the state)."
  } | tee -a "$log"
  pulumi cancel --yes "${common[@]}" 2>&1 | tee -a "$log"
fi
exit "$rc"
