#!/usr/bin/env bash
# One Pulumi command on one stack, as the CI workflows run it (preview.yml, deploy.yml):
#   .ci/pulumi-run.sh preview STACK           # PR previews and the deploy's preview (reads state only)
#   .ci/pulumi-run.sh preview-destroy STACK   # what `destroy` would delete (the bucket backend locks for it)
#   .ci/pulumi-run.sh up STACK | destroy STACK
#   .ci/pulumi-run.sh cancel STACK            # release the lock of a run that was killed
#
# Environment: PULUMI_BACKEND_URL (gs://… bucket backend) or PULUMI_ACCESS_TOKEN (Pulumi Cloud, then
# PULUMI_ORG names the organisation); GCP_PROJECT_ID (bucket backend: names the stack's KMS key, checked before
# a preview or deploy); PULUMI_REVIEWED_PLAN (`up`/`destroy`: the plan digest of the reviewed preview); PULUMI_BUDGET / PULUMI_GRACE bound `up` and `destroy`
# (defaults 240m / 60m); PULUMI_CANCEL_WAIT (seconds, default 180) bounds how long `cancel` waits for an
# interrupted run (at most 200); PULUMI_LOG is where the output goes (default $RUNNER_TEMP/pulumi.log).
# Writes `exit-code=N` and `log=PATH` to $GITHUB_OUTPUT for the report step (.ci/preview_report.py).
#
# Decisions
# - The stack is only selected, never created: previews read state and cannot create it, and a new
#   stack is created once by infra/bootstrap/ci-setup.sh (docs/ci.md, "New stacks"); a missing stack fails with
#   the `pulumi stack init … --secrets-provider gcpkms://…` command in the message instead of Pulumi's "no stack
#   named …". On a bucket backend a stack created without --secrets-provider is on a passphrase, which CI does
#   not have, and each stack has its own KMS key (ci-identities.yaml `state-key`): a stack file that does not
#   name that key stops here, with the `pulumi stack change-secrets-provider` command that moves it.
# - `up`/`destroy` with PULUMI_REVIEWED_PLAN run what the reviewers approved or nothing: the plan is previewed
#   again and its digest (.ci/plan_digest.py: every step's operation, resource and changed properties, from
#   Pulumi's engine event log) must equal the reviewed one, else the run stops before changing anything.
# - `up`/`destroy` get a budget shorter than the job's timeout-minutes: when it runs out, `timeout`
#   sends SIGINT, which Pulumi handles as a cancellation that waits for a safe point before exiting
#   (pulumi/pulumi#1231), so state is written and the lock released; only if Pulumi is still running
#   after PULUMI_GRACE is it killed, and then `pulumi cancel` removes the lock it left (the diy
#   backend's CancelCurrentUpdate deletes the stack's lock files; Pulumi Cloud cancels the update).
#   GitHub never has to kill Pulumi mid-operation, which would leave the lock for the next deploy.
#   `--foreground` makes that SIGINT the only one: without it `timeout` signals the command and then
#   its whole process group (coreutils timeout.c, cleanup()), so Pulumi could see two, and Pulumi takes
#   a second ^C as "terminate immediately" (pkg/cmd/pulumi cancellationScopeSource), the very kill
#   the budget is there to avoid. Only Pulumi is signalled: it shuts its plugins down as it cancels
#   (after a kill, the runner ends what is left with the job). For the same reason `timeout` runs in a
#   session of its own (setsid), away from the signals a terminal's Ctrl-C or the runner sends the
#   script's process group, which would reach Pulumi besides the one `timeout` forwards; the script
#   traps SIGINT/SIGTERM and hands the first one to `timeout` as one SIGINT, so a cancelled job starts
#   Pulumi's cancellation at once (the runner signals only the step's process: the workflow `exec`s this
#   script), and `cancel` waits for that cancellation (PULUMI_CANCEL_WAIT) before it releases the lock.
#   A signal during login or stack select ends the script (130) before Pulumi starts; one that comes
#   before `timeout` has started Pulumi is handed on once it has. When the budget's grace runs out,
#   what is left of the run (Pulumi's plugins) is killed with it.
# - Every command runs with the policy pack except `cancel`, and without colour so the report can
#   quote the policy violations verbatim.
# Not here: installing Pulumi or credentials (the workflow's steps before this one).
set -euo pipefail
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "error: $0 needs bash 5.1 or newer (wait -n -p); this is bash $BASH_VERSION" >&2
  exit 2
fi

usage="usage: $0 preview|preview-destroy|up|destroy|cancel STACK"
command="${1:?$usage}"
stack="${2:?$usage}"
if [[ ! "$stack" =~ ^[A-Za-z0-9_.-]+$ ]]; then
  echo "error: stack name '$stack' may only hold letters, digits, '_', '.' and '-'" >&2
  exit 2
fi
budget="${PULUMI_BUDGET:-240m}"
grace="${PULUMI_GRACE:-60m}"
log="${PULUMI_LOG:-${RUNNER_TEMP:-/tmp}/pulumi.log}"
pidfile="${RUNNER_TEMP:-/tmp}/pulumi-run.pid" # a running `up`/`destroy` (its timeout), for `cancel`
# Seconds `cancel` waits for it, at most 200: the runner kills a cancelled job's worker 285 s after the
# cancel (5 min less 15 s), and the apply step's end, login and `pulumi cancel` take ~25 s of that
cancel_wait="${PULUMI_CANCEL_WAIT:-180}"
if [[ "$cancel_wait" =~ ^[0-9]{1,6}$ ]]; then
  cancel_wait=$((10#$cancel_wait)) # "09" is nine seconds, not an octal error
else
  cancel_wait=200
fi
if ((cancel_wait > 200)); then
  cancel_wait=200
fi

# whether any process of session $1 is alive (a zombie is not: pgrep matches zombies unless told the
# states, and its --runstates is missing from older procps); awk reads all of ps's output, so ps
# never dies of SIGPIPE under pipefail and makes a live session look gone
session_alive() {
  ps -o stat= -s "$1" 2>/dev/null | awk '$1 !~ /^Z/ { alive = 1 } END { exit !alive }'
}

# `up`/`destroy`: a SIGINT or SIGTERM (a cancelled job; Ctrl-C) is counted from the start, so one that
# comes during login or stack select stops the script before Pulumi starts (the runner signals only
# this shell, and bash runs a trap once the foreground command has finished)
signals=0 forwarded=0 bounded=""
# Hands the first signal to `timeout` as one SIGINT, once timeout has started Pulumi: bash starts a
# background command with SIGINT ignored, and until timeout has installed its handlers (it does so
# before it forks the command: coreutils timeout.c) a SIGINT to it would be lost. A trap can run
# between any two commands, this function's too: the test and the set are one arithmetic command, so
# a second signal that comes meanwhile cannot forward a second SIGINT.
# shellcheck disable=SC2329  # called by the INT/TERM trap and the wait loop
forward_signal() {
  ((signals > 0 && forwarded == 0)) && [[ -n "$bounded" ]] && pgrep -P "$bounded" >/dev/null || return 0
  ((forwarded++ == 0)) || return 0
  kill -INT "$bounded" 2>/dev/null
}
if [[ "$command" == "up" || "$command" == "destroy" ]]; then
  trap 'signals=$((signals + 1)); forward_signal' INT TERM
fi
qualified="$stack"
if [[ -n "${PULUMI_ORG:-}" ]]; then
  qualified="${PULUMI_ORG}/gemma-finetune/${stack}"
fi
# bucket backend: the stack's own key (infra/bootstrap/ci-setup.sh creates it and the stack on it). The hints
# name the setup's default key ring; the check takes the key gft-STACK in any location and key ring of the project,
# as the setup's KMS_LOCATION / KMS_KEYRING may place it (an org policy on resource locations can forbid `global`):
# IAM on each key is the gate, this check only stops a stack on a passphrase or another stack's key early.
provider="" provider_pattern=""
if [[ -n "${PULUMI_BACKEND_URL:-}" && -n "${GCP_PROJECT_ID:-}" ]]; then
  provider="gcpkms://projects/$GCP_PROJECT_ID/locations/global/keyRings/gft-pulumi/cryptoKeys/gft-$stack"
  provider_pattern="^gcpkms://projects/${GCP_PROJECT_ID//./\\.}/locations/[a-z0-9-]+/keyRings/[A-Za-z0-9_-]+/cryptoKeys/gft-${stack//./\\.}\$"
fi
policy=(--policy-pack infra/policy)
common=(--stack "$qualified" --color never --non-interactive)

rc=1
# the engine's event log of a preview (PULUMI_DEBUG_COMMANDS=true offers --event-log: .ci/plan_digest.py)
events="${RUNNER_TEMP:-/tmp}/pulumi-events.jsonl"
digest=""
# shellcheck disable=SC2329  # called by the EXIT trap
report() {
  if [[ -n "${GITHUB_OUTPUT:-}" ]]; then
    printf 'exit-code=%s\nlog=%s\n' "$rc" "$log" >>"$GITHUB_OUTPUT"
    if [[ -n "$digest" ]]; then
      printf 'plan-digest=%s\n' "$digest" >>"$GITHUB_OUTPUT"
    fi
  fi
}
plan_digest() { python3 "$(dirname "${BASH_SOURCE[0]}")/plan_digest.py" "$@"; }
trap report EXIT
: >"$log"

if [[ -n "${PULUMI_BACKEND_URL:-}" ]]; then
  pulumi login --non-interactive "$PULUMI_BACKEND_URL" | tee -a "$log"
else
  pulumi login --non-interactive | tee -a "$log"
fi

if [[ "$command" == "cancel" ]]; then
  set +e
  # an interrupted `up`/`destroy` of this job may still be cancelling at a safe point: releasing the
  # lock under it would let the next deploy run beside it, so wait for it, and kill it past the wait
  # Pulumi starts its plugins in process groups of their own, all in timeout's session: the session is
  # what is waited for and killed
  if [[ -s "$pidfile" ]]; then
    read -r sid run_log <"$pidfile"
    if [[ "$sid" =~ ^[0-9]+$ ]] && session_alive "$sid"; then
      echo "pulumi (session $sid) is still finishing: waiting up to ${cancel_wait}s for it" | tee -a "$log"
      waited=0
      while session_alive "$sid" && ((waited < cancel_wait)); do
        sleep 1
        waited=$((waited + 1))
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

case "$command" in
  preview) args=(preview "${common[@]}" --diff "${policy[@]}" --event-log "$events") ;;
  preview-destroy) args=(destroy "${common[@]}" --preview-only --event-log "$events") ;;
  up) args=(up "${common[@]}" --yes --diff "${policy[@]}") ;;
  destroy) args=(destroy "${common[@]}" --yes) ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac

set +e
rm -f "$events"
if [[ ("$command" == "up" || "$command" == "destroy") && -n "${PULUMI_REVIEWED_PLAN:-}" ]]; then
  # what the reviewers approved, or nothing: the same preview again, and its digest must be theirs
  again=(preview "${common[@]}" --diff "${policy[@]}" --event-log "$events")
  if [[ "$command" == "destroy" ]]; then
    again=(destroy "${common[@]}" --preview-only --event-log "$events")
  fi
  echo "previewing again: pulumi $command runs only the reviewed plan ($PULUMI_REVIEWED_PLAN)" | tee -a "$log"
  PULUMI_DEBUG_COMMANDS=true pulumi "${again[@]}" 2>&1 | tee -a "$log"
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
if [[ "$command" == "up" || "$command" == "destroy" ]]; then
  if ((signals > 0)); then
    echo "cancelled before pulumi $command started: nothing was changed" | tee -a "$log"
    rc=130
    exit "$rc"
  fi
  # in a session of its own (no Ctrl-C or runner signal reaches it directly); its output goes to the log,
  # which `tail` follows onto the console until it exits
  # A cancelled job or Ctrl-C: one SIGINT, through timeout, which hands Pulumi exactly that one (the
  # first signal only: the runner sends SIGINT, then SIGTERM 7.5 s later); the cancel step finds the run
  # through the pid file and waits for it before it releases the lock
  start=$(($(stat -c %s "$log") + 1))
  setsid timeout --foreground --signal=INT --kill-after="$grace" "$budget" pulumi "${args[@]}" >>"$log" 2>&1 &
  bounded=$!
  echo "$bounded $log" >"$pidfile"
  tail -c "+$start" -f --pid="$bounded" "$log" &
  follower=$!
  # A trapped signal ends `wait` at once; one that comes just before `wait` starts is only trapped, so
  # `wait` also ends with a tick, after which a signal not yet handed on is: every 5 s, or every 0.1 s
  # while one waits for timeout to start Pulumi
  while true; do
    forward_signal
    tick_s=5
    if ((signals > 0 && forwarded == 0)); then
      tick_s=0.1
    fi
    sleep "$tick_s" &
    tick=$!
    finished=""
    wait -n -p finished "$bounded" "$tick" # bash >= 5.1
    status=$?
    kill "$tick" 2>/dev/null
    if [[ "${finished:-}" == "$bounded" ]]; then # -p unsets it when a signal ends wait
      rc=$status
      break
    fi # else the tick, or a trapped signal ended `wait`, not the command: wait again
  done
  # counted, no longer handed on: the runner's SIGTERM can come while the follower drains (tail --pid
  # looks once a second) or `pulumi cancel` runs, and must not turn Pulumi's exit code into 143
  trap 'signals=$((signals + 1))' INT TERM
  rm -f "$pidfile"
  wait "$follower"
  while kill -0 "$follower" 2>/dev/null; do # a signal ended `wait`: the follower is still draining
    wait "$follower"
  done
  if [[ "$rc" == 137 ]]; then
    # killed past its grace: Pulumi's plugins run in process groups of their own, in timeout's session
    pkill -KILL -s "$bounded" 2>/dev/null
  fi
  if [[ "$rc" == 124 || "$rc" == 137 ]]; then
    {
      echo "error: pulumi $command ran past its budget of $budget and was interrupted (exit $rc)."
      echo "error: releasing any lock it left with \`pulumi cancel\`; then run \`pulumi refresh --stack $qualified\`"
      echo "error: and deploy again (resources created before the interruption are in the state)."
    } | tee -a "$log"
    pulumi cancel --yes "${common[@]}" 2>&1 | tee -a "$log"
  fi
else
  PULUMI_DEBUG_COMMANDS=true pulumi "${args[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)) && [[ -s "$events" ]]; then
    digest=$(plan_digest "$events")
    echo "plan digest: $digest (deploy.yml's apply job runs this plan or nothing)" | tee -a "$log"
  fi
fi
exit "$rc"
