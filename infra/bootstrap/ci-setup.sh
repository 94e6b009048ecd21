#!/usr/bin/env bash
# One-time setup of what the CI workflows need in Google Cloud: the APIs, the four CI identities and
# their Workload Identity Federation (no JSON keys), every service account the program uses for every
# stack, and the bucket backend's state bucket, a KMS key per stack and the stacks themselves on their keys;
# at the end it reports (PRUNE=1: removes) the CI grants ci-identities.yaml no longer lists. Run it as a project owner, from a checkout:
#
#   PROJECT_ID=my-gft-project GITHUB_REPO=my-org/gemma-finetune \
#   GITHUB_REPO_ID=$(gh api repos/my-org/gemma-finetune --jq .id) \
#   GITHUB_OWNER_ID=$(gh api repos/my-org/gemma-finetune --jq .owner.id) \
#     infra/bootstrap/ci-setup.sh
#
# Run it again after adding a stack file or changing a stack's workload, capacity or imageBuild (it creates
# that stack's accounts and grants), or after changing this script: every step checks first or is
# idempotent in gcloud itself.
#
# Decisions (docs/ci.md has the table; ci-identities.yaml the reason of each grant;
# infra/offline/permissions.py proves them against what the program declares)
# - A dedicated project for the stacks is strongly recommended: Artifact Registry, Cloud Run and GKE do not
#   support IAM Conditions on resource names, so those grants cover the project.
# - No identity holds a project-wide service-account role (serviceAccountUser/Admin/TokenCreator),
#   storage.admin or secretmanager.admin: IAM Conditions cannot match service-account names, so every
#   account the program uses (gft-<stack>-train, -serve, -node, -build) is created here, per stack, with the
#   program's display name, and the deploy identity gets actAs / setIamPolicy on exactly those; `pulumi up`
#   adopts them and `pulumi destroy` leaves them (infra/foundation.py). Buckets and secrets are reached
#   through IAM Conditions on their name prefixes (`<project>-gft-`, `gft-`).
# - A create or a list is authorised on the project before a resource has a name a condition could match:
#   each such permission set is a small custom role (gftCi*Creator, gftCiBucketLister,
#   gftCiReservationReader). The deploy identity changes the project's IAM policy only through
#   gftCiProjectIamGranter, conditioned on `modifiedGrantsByRole` to the project roles the program grants (the
#   node and builder accounts' log roles). A GKE stack's condition names both: the provider batches the project
#   IAM members of one update into one setIamPolicy, which IAM judges as a whole.
# - The deploy identity cannot enable APIs: every API any stack declares is enabled here, and the
#   program's gcp.projects.Service resources only find them enabled.
# - Federation is one pool per identity, each with one GitHub provider whose attribute condition is
#   the gate, on numeric repository and owner ids (never names, which can be re-registered):
#     gft-preview         pull_request events of this repository
#     gft-preview-gke     the same, in the reviewed `preview-gke` environment only
#     gft-deploy-preview  deploy.yml running on refs/heads/main, dispatched by hand (its read-only preview)
#     gft-deploy          the same, in the reviewed `deploy` or `destroy` environment only
# - Bucket backend: secrets are encrypted with a Cloud KMS key per stack, not a passphrase, so GitHub holds no
#   static secret at all; a CI identity gets decrypt only (Pulumi wraps a data key with KMS), and only on the
#   keys of the stacks it runs (docs/ci.md, "Stacks and their keys").
#
# Not here: GitHub settings (environments, reviewers, variables: printed at the end), creating stacks
# (`pulumi stack init`, docs/ci.md "New stacks"), grants in another project that owns a stack's reservation
# (`reservationProject`: give the CI identities compute.reservations.get and compute.zones.list there).
set -euo pipefail

# ---------------------------------------------------------------------------------------- settings
PROJECT_ID="${PROJECT_ID:-}"              # the project every stack deploys into (gcp:project)
GITHUB_REPO="${GITHUB_REPO:-}"            # owner/name
GITHUB_REPO_ID="${GITHUB_REPO_ID:-}"      # gh api repos/OWNER/NAME --jq .id
GITHUB_OWNER_ID="${GITHUB_OWNER_ID:-}"    # gh api repos/OWNER/NAME --jq .owner.id
STATE_BACKEND="${STATE_BACKEND:-bucket}"  # bucket (gs://, KMS-encrypted secrets) | pulumi-cloud
STATE_BUCKET="${STATE_BUCKET:-${PROJECT_ID}-pulumi-state}"
STATE_LOCATION="${STATE_LOCATION:-us-central1}"
KMS_LOCATION="${KMS_LOCATION:-global}"
KMS_KEYRING="${KMS_KEYRING:-gft-pulumi}"
PULUMI="${PULUMI:-pulumi}"                # the Pulumi CLI that creates or migrates the stacks (bucket backend)
PRUNE="${PRUNE:-0}"                       # 1: remove the CI identities' grants this run did not make (else: report them)
REPO_ROOT="${REPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"

APIS=(
  sts.googleapis.com iamcredentials.googleapis.com iam.googleapis.com
  cloudresourcemanager.googleapis.com serviceusage.googleapis.com cloudkms.googleapis.com
  storage.googleapis.com artifactregistry.googleapis.com secretmanager.googleapis.com
  container.googleapis.com compute.googleapis.com logging.googleapis.com run.googleapis.com
  cloudbuild.googleapis.com cloudquotas.googleapis.com billingbudgets.googleapis.com monitoring.googleapis.com
)

# ---------------------------------------------------------------------------------------- checks
fail() {
  echo "error: $*" >&2
  exit 2
}
[[ "$PROJECT_ID" =~ ^[a-z][a-z0-9-]{4,28}[a-z0-9]$ ]] ||
  fail "PROJECT_ID='$PROJECT_ID' is not a project id; find yours with: gcloud projects list"
[[ "$GITHUB_REPO" =~ ^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$ ]] ||
  fail "GITHUB_REPO='$GITHUB_REPO' is not owner/name"
[[ "$GITHUB_REPO_ID" =~ ^[0-9]+$ ]] ||
  fail "GITHUB_REPO_ID='$GITHUB_REPO_ID' is not a number; find it with: gh api repos/$GITHUB_REPO --jq .id"
[[ "$GITHUB_OWNER_ID" =~ ^[0-9]+$ ]] ||
  fail "GITHUB_OWNER_ID='$GITHUB_OWNER_ID' is not a number; find it with: gh api repos/$GITHUB_REPO --jq .owner.id"
[[ "$STATE_BACKEND" == bucket || "$STATE_BACKEND" == pulumi-cloud ]] ||
  fail "STATE_BACKEND='$STATE_BACKEND' is not bucket or pulumi-cloud"
STACK_LINES=$(python3 "$REPO_ROOT/.ci/stacks.py" --lines --root "$REPO_ROOT")

PROJECT_NUMBER=$(gcloud projects describe "$PROJECT_ID" --format='value(projectNumber)')
[[ "$PROJECT_NUMBER" =~ ^[0-9]+$ ]] || fail "could not read the project number of $PROJECT_ID"
KEYRING_NAME="projects/$PROJECT_ID/locations/$KMS_LOCATION/keyRings/$KMS_KEYRING"
# One key per stack (ci-identities.yaml `state-key`): an identity decrypts only the stacks of its workloads
stack_key() { echo "gft-$1"; }
secrets_provider() { echo "gcpkms://$KEYRING_NAME/cryptoKeys/$(stack_key "$1")"; }

step() { echo "== $*"; }
account() { echo "$1@$PROJECT_ID.iam.gserviceaccount.com"; }
member() { echo "serviceAccount:$(account "$1")"; }

# Every binding this run makes to a CI identity, one a line: KIND TARGET MEMBER ROLE EXPRESSION (tab-separated),
# so what the CI identities hold beyond them is reported (or removed with PRUNE=1) at the end
made_grants=$(mktemp)
trap 'rm -f "$made_grants"' EXIT
made() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$made_grants"; }

# A project binding, with an IAM Condition when a third argument is given (its title: the fourth, else the
# role's id). `^;^` makes `;` gcloud's item separator, so the expression may hold commas (gcloud topic
# escaping); no expression here holds a `;`.
grant_project() {
  local who="$1" role="$2" expression="${3:-}" title="${4:-gft-ci-${2##*/}}"
  local condition=None
  if [[ -n "$expression" ]]; then
    condition="^;^expression=$expression;title=$title"
  fi
  gcloud projects add-iam-policy-binding "$PROJECT_ID" --member="$(member "$who")" --role="$role" \
    --condition="$condition" --quiet >/dev/null
  made project "$PROJECT_ID" "$(member "$who")" "$role" "$expression"
}
grant_account() {
  local who="$1" role="$2" target="$3"
  gcloud iam service-accounts add-iam-policy-binding "$target" --project="$PROJECT_ID" \
    --member="$(member "$who")" --role="$role" --quiet >/dev/null
  made account "$target" "$(member "$who")" "$role" ""
}
grant_state() {
  local who="$1" bucket_role="$2" expression="${3:-}" title="${4:-gft-ci-${2##*/}}"
  [[ "$STATE_BACKEND" == bucket ]] || return 0
  local conditioned=()
  if [[ -n "$expression" ]]; then
    conditioned=(--condition="^;^expression=$expression;title=$title")
  fi
  gcloud storage buckets add-iam-policy-binding "gs://$STATE_BUCKET" --member="$(member "$who")" \
    --role="$bucket_role" "${conditioned[@]}" --quiet >/dev/null
  made bucket "gs://$STATE_BUCKET" "$(member "$who")" "$bucket_role" "$expression"
}
# Decrypt on one stack's key (the data key of its secrets: pulumi pkg/secrets/cloud/manager.go)
grant_key() {
  local who="$1" key="$2"
  gcloud kms keys add-iam-policy-binding "$key" --keyring="$KMS_KEYRING" --location="$KMS_LOCATION" \
    --project="$PROJECT_ID" --member="$(member "$who")" --role=roles/cloudkms.cryptoKeyDecrypter --quiet >/dev/null
  made key "$key" "$(member "$who")" roles/cloudkms.cryptoKeyDecrypter ""
}
ensure_key() {
  local key="$1"
  if ! gcloud kms keys describe "$key" --keyring="$KMS_KEYRING" --location="$KMS_LOCATION" \
    --project="$PROJECT_ID" >/dev/null 2>&1; then
    gcloud kms keys create "$key" --keyring="$KMS_KEYRING" --location="$KMS_LOCATION" \
      --project="$PROJECT_ID" --purpose=encryption
  fi
}
ensure_account() {
  local id="$1" title="$2"
  if ! gcloud iam service-accounts describe "$(account "$id")" --project="$PROJECT_ID" >/dev/null 2>&1; then
    gcloud iam service-accounts create "$id" --project="$PROJECT_ID" --display-name="$title"
  fi
}
ensure_custom_role() {
  local id="$1" title="$2" permissions="$3"
  if gcloud iam roles describe "$id" --project="$PROJECT_ID" >/dev/null 2>&1; then
    gcloud iam roles update "$id" --project="$PROJECT_ID" --permissions="$permissions" --quiet >/dev/null
  else
    gcloud iam roles create "$id" --project="$PROJECT_ID" --title="$title" --permissions="$permissions" \
      --stage=GA --quiet
  fi
}
# One pool and one GitHub provider per identity; the provider's attribute condition is the gate and is
# rewritten on every run, so the condition in this file is the one in force.
ensure_federation() {
  local who="$1" pool="$2" condition="$3"
  if ! gcloud iam workload-identity-pools describe "$pool" --project="$PROJECT_ID" --location=global \
    >/dev/null 2>&1; then
    gcloud iam workload-identity-pools create "$pool" --project="$PROJECT_ID" --location=global \
      --display-name="gemma-finetune CI: $who"
  fi
  local verb=create-oidc
  if gcloud iam workload-identity-pools providers describe github --project="$PROJECT_ID" --location=global \
    --workload-identity-pool="$pool" >/dev/null 2>&1; then
    verb=update-oidc
  fi
  gcloud iam workload-identity-pools providers "$verb" github --project="$PROJECT_ID" --location=global \
    --workload-identity-pool="$pool" --issuer-uri="https://token.actions.githubusercontent.com" \
    --attribute-mapping="google.subject=assertion.sub" --attribute-condition="$condition"
  # Every identity the pool admits (principal-identifiers: principalSet://…/workloadIdentityPools/POOL/*).
  local principals="principalSet://iam.googleapis.com/projects/$PROJECT_NUMBER/locations/global/workloadIdentityPools/$pool/*"
  gcloud iam service-accounts add-iam-policy-binding "$(account "$who")" --project="$PROJECT_ID" \
    --member="$principals" --role=roles/iam.workloadIdentityUser --quiet >/dev/null
}

# ---------------------------------------------------------------------------------------- APIs
step "APIs (federation, the program's reads, every stack's services)"
gcloud services enable "${APIS[@]}" --project="$PROJECT_ID"

# ---------------------------------------------------------------------------------------- identities
step "CI identities"
ensure_account gft-ci-preview "gemma-finetune CI: PR previews (Cloud Run stacks)"
ensure_account gft-ci-preview-gke "gemma-finetune CI: reviewed PR previews (GKE stacks)"
ensure_account gft-ci-deploy-preview "gemma-finetune CI: deploy previews from main (read-only)"
ensure_account gft-ci-deploy "gemma-finetune CI: reviewed deploys from main"

ids="assertion.repository_id == '$GITHUB_REPO_ID' && assertion.repository_owner_id == '$GITHUB_OWNER_ID'"
ensure_federation gft-ci-preview gft-preview "$ids && assertion.event_name == 'pull_request'"
ensure_federation gft-ci-preview-gke gft-preview-gke \
  "$ids && assertion.event_name == 'pull_request' && assertion.environment == 'preview-gke'"
# workflow_ref is compared with the token's own `repository` (GitHub's spelling), not with what was typed here
main_deploy="assertion.ref == 'refs/heads/main' && assertion.event_name == 'workflow_dispatch' && assertion.workflow_ref == assertion.repository + '/.github/workflows/deploy.yml@refs/heads/main'"
ensure_federation gft-ci-deploy-preview gft-deploy-preview "$ids && $main_deploy"
# the deploy identity only for a job that a reviewer let into the deploy or destroy environment
ensure_federation gft-ci-deploy gft-deploy "$ids && $main_deploy && assertion.environment in ['deploy', 'destroy']"

# ---------------------------------------------------------------------------------------- state
if [[ "$STATE_BACKEND" == bucket ]]; then
  step "State bucket gs://$STATE_BUCKET and KMS key ring $KEYRING_NAME"
  if ! gcloud storage buckets describe "gs://$STATE_BUCKET" >/dev/null 2>&1; then
    gcloud storage buckets create "gs://$STATE_BUCKET" --project="$PROJECT_ID" --location="$STATE_LOCATION" \
      --uniform-bucket-level-access --public-access-prevention
  fi
  gcloud storage buckets update "gs://$STATE_BUCKET" --versioning --quiet >/dev/null
  if ! gcloud kms keyrings describe "$KMS_KEYRING" --location="$KMS_LOCATION" --project="$PROJECT_ID" \
    >/dev/null 2>&1; then
    gcloud kms keyrings create "$KMS_KEYRING" --location="$KMS_LOCATION" --project="$PROJECT_ID"
  fi
fi
# What the stack files use: workloads, and features (.ci/stacks.py: reservation, gpu-quota, budget, cloud-build,
# alert-emails).
workloads=$(echo "$STACK_LINES" | awk '{print $2}' | sort -u)
features=$(echo "$STACK_LINES" | awk '{print $3}' | tr ',' '\n' | sort -u)
has_cloud_run=false has_gke=false has_reservation=false has_cloud_build=false has_gpu_quota=false has_budget=false
has_alert_emails=false
grep -qx cloud-run <<<"$workloads" && has_cloud_run=true
grep -qx -e gke-job -e gke-ray <<<"$workloads" && has_gke=true
grep -qx reservation <<<"$features" && has_reservation=true
grep -qx cloud-build <<<"$features" && has_cloud_build=true
has_cloud_run_cloud_build=false
awk '$2 == "cloud-run" && ("," $3 ",") ~ /,cloud-build,/ {found = 1} END {exit !found}' <<<"$STACK_LINES" &&
  has_cloud_run_cloud_build=true
grep -qx budget <<<"$features" && has_budget=true
grep -qx alert-emails <<<"$features" && has_alert_emails=true
# GKE stacks whose capacity draws on GPU quota (the Cloud Run stacks always do).
if $has_gke && echo "$STACK_LINES" | awk '$2 != "cloud-run" {print $3}' | tr ',' '\n' | grep -qx gpu-quota; then
  has_gpu_quota=true
fi

# ---------------------------------------------------------------------------------------- default build account
# cloudbuild.builds.editor lets the deploy identity submit any build, and a build that names no account runs as
# the project's default one. The Compute Engine default account needs actAs of whoever submits (Cloud Build docs,
# "Cloud Build default service account change"), which no CI identity holds. The legacy Cloud Build account
# (PROJECT_NUMBER@cloudbuild.gserviceaccount.com: projects that ran builds before Google's 2024 change) needs
# none and is granted the Cloud Build Service Account role: objects of every bucket, the state too (Cloud Build
# docs, "Cloud Build service account"). With a stack on imageBuild: cloud-build the setup refuses a legacy default
# that holds any project role, and reports the default account it finds.
if $has_cloud_build; then
  step "Default Cloud Build account (a build that names no --service-account runs as it)"
  default_build=$(gcloud builds get-default-service-account --project="$PROJECT_ID" \
    --format='value(serviceAccountEmail)') || fail "could not read the default Cloud Build account of $PROJECT_ID"
  default_build=${default_build##*/}
  legacy_build="$PROJECT_NUMBER@cloudbuild.gserviceaccount.com"
  if [[ "$default_build" == "$legacy_build" ]]; then
    legacy_roles=$(gcloud projects get-iam-policy "$PROJECT_ID" --flatten='bindings[].members' \
      --filter="bindings.members:serviceAccount:$legacy_build" --format='value(bindings.role)')
    if [[ -n "$legacy_roles" ]]; then
      fail "the default Cloud Build account is the legacy $legacy_build, which holds ${legacy_roles//$'\n'/ }: the deploy
identity could submit a build that names no account and act with those roles (every bucket, the state included).
Fix: remove its project roles (the stacks' builds run as gft-<stack>-build), for each ROLE of them:
  gcloud projects remove-iam-policy-binding $PROJECT_ID --member=serviceAccount:$legacy_build --role=ROLE
then run this script again"
    fi
    echo "default build account: the legacy $legacy_build, holding no project role"
  else
    echo "default build account: ${default_build:-none} (a build naming no account needs actAs on it: no CI identity has it)"
  fi
fi

if $has_cloud_run; then grant_state gft-ci-preview roles/storage.objectViewer; fi
if $has_gke; then grant_state gft-ci-preview-gke roles/storage.objectViewer; fi
grant_state gft-ci-deploy-preview roles/storage.objectViewer
# a destroy preview locks the stack (diy Destroy, even with --preview-only): the lock objects, nothing else
grant_state gft-ci-deploy-preview roles/storage.objectUser \
  "resource.name.startsWith('projects/_/buckets/$STATE_BUCKET/objects/.pulumi/locks/')" gft-ci-state-locks
grant_state gft-ci-deploy roles/storage.objectUser

# ---------------------------------------------------------------------------------------- project grants
step "Project grants (custom create/list roles, conditions on bucket and secret names and on granted roles)"
ensure_custom_role gftCiBucketCreator "gemma-finetune CI bucket creator" storage.buckets.create
ensure_custom_role gftCiBucketLister "gemma-finetune CI bucket lister" storage.buckets.list
ensure_custom_role gftCiSecretCreator "gemma-finetune CI secret creator" secretmanager.secrets.create
ensure_custom_role gftCiAccountCreator "gemma-finetune CI service account creator" iam.serviceAccounts.create
ensure_custom_role gftCiReservationReader "gemma-finetune CI reservation reader" \
  compute.reservations.get,compute.zones.list
ensure_custom_role gftCiQuotaReader "gemma-finetune CI quota reader" cloudquotas.quotas.get
ensure_custom_role gftCiProjectIamGranter "gemma-finetune CI project IAM granter" \
  resourcemanager.projects.getIamPolicy,resourcemanager.projects.setIamPolicy
ensure_custom_role gftCiAdmissionFenceApplier "gemma-finetune CI admission fence applier" \
  container.clusterRoles.get,container.clusterRoles.create,container.clusterRoles.update,container.clusterRoles.escalate,container.clusterRoles.bind,container.clusterRoleBindings.get,container.clusterRoleBindings.create,container.clusterRoleBindings.update
ensure_custom_role gftCiLogMetricWriter "gemma-finetune CI log-based metric writer" \
  logging.logMetrics.create,logging.logMetrics.delete,logging.logMetrics.get,logging.logMetrics.update,monitoring.metricDescriptors.list
ensure_custom_role gftCiWorkloadIdentityBinder "gemma-finetune CI Workload Identity binder" \
  iam.serviceAccounts.get,iam.serviceAccounts.getIamPolicy,iam.serviceAccounts.setIamPolicy
custom="projects/$PROJECT_ID/roles"
buckets="resource.name.startsWith('projects/_/buckets/$PROJECT_ID-gft-')"
secrets="resource.name.startsWith('projects/$PROJECT_NUMBER/secrets/gft-') || resource.name.startsWith('projects/$PROJECT_ID/secrets/gft-')"
# IAM docs, "Set limits on granting roles": the policy change may add or remove grants of these roles only.
# The provider sends the project IAM members one update creates as one batched setIamPolicy, so a GKE stack's
# condition names both roles it may grant at once (ci-identities.yaml).
grants_only() {
  local roles
  roles=$(printf "'%s', " "$@")
  echo "api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', []).hasOnly([${roles%, }])"
}

if $has_cloud_run; then
  grant_project gft-ci-preview "$custom/gftCiBucketLister"
  grant_project gft-ci-preview "$custom/gftCiQuotaReader"
fi
if $has_gke; then
  grant_project gft-ci-preview-gke "$custom/gftCiBucketLister"
  grant_project gft-ci-preview-gke roles/storage.bucketViewer "$buckets"
  grant_project gft-ci-preview-gke roles/container.developer
  if $has_reservation; then grant_project gft-ci-preview-gke "$custom/gftCiReservationReader"; fi
  if $has_gpu_quota; then grant_project gft-ci-preview-gke "$custom/gftCiQuotaReader"; fi
fi

# deploy.yml's preview job: what the previews above may do, for every stack, and nothing the apply does
grant_project gft-ci-deploy-preview "$custom/gftCiBucketLister"
grant_project gft-ci-deploy-preview roles/storage.bucketViewer "$buckets"
# the served run's markers (Cloud Run) and, on every stack whose bucket exists, the run's completion marker
grant_project gft-ci-deploy-preview roles/storage.objectViewer "$buckets"
if $has_cloud_run; then
  grant_project gft-ci-deploy-preview "$custom/gftCiQuotaReader"
fi
if $has_gke; then
  grant_project gft-ci-deploy-preview roles/container.developer
  if $has_reservation; then grant_project gft-ci-deploy-preview "$custom/gftCiReservationReader"; fi
  if $has_gpu_quota; then grant_project gft-ci-deploy-preview "$custom/gftCiQuotaReader"; fi
fi

grant_project gft-ci-deploy "$custom/gftCiBucketLister"
grant_project gft-ci-deploy "$custom/gftCiBucketCreator"
grant_project gft-ci-deploy roles/storage.admin "$buckets"
grant_project gft-ci-deploy roles/artifactregistry.admin
grant_project gft-ci-deploy "$custom/gftCiAccountCreator"
# every stack's dashboard, alert policies and log-based metrics (infra/monitoring.py)
grant_project gft-ci-deploy "$custom/gftCiLogMetricWriter"
grant_project gft-ci-deploy roles/monitoring.dashboardEditor
grant_project gft-ci-deploy roles/monitoring.alertPolicyEditor
if $has_cloud_run; then
  # GKE stacks: roles/compute.networkAdmin holds serviceusage.services.list
  grant_project gft-ci-deploy roles/serviceusage.serviceUsageViewer
  grant_project gft-ci-deploy "$custom/gftCiSecretCreator"
  grant_project gft-ci-deploy roles/secretmanager.admin "$secrets"
  grant_project gft-ci-deploy roles/run.admin
fi
if $has_gke; then
  grant_project gft-ci-deploy roles/container.clusterAdmin
  grant_project gft-ci-deploy roles/compute.networkAdmin
  grant_project gft-ci-deploy roles/container.developer
  grant_project gft-ci-deploy "$custom/gftCiAdmissionFenceApplier"
  grant_project gft-ci-deploy "$custom/gftCiProjectIamGranter" \
    "$(grants_only roles/container.defaultNodeServiceAccount roles/logging.logWriter)" gft-ci-grant-project-log-roles
  if $has_reservation; then grant_project gft-ci-deploy "$custom/gftCiReservationReader"; fi
fi
if $has_cloud_run || $has_gpu_quota; then grant_project gft-ci-deploy "$custom/gftCiQuotaReader"; fi
if $has_budget || $has_alert_emails; then
  grant_project gft-ci-deploy roles/monitoring.notificationChannelEditor
fi
if $has_budget; then
  # A budget lives on the billing account: granting there needs Billing Account Administrator on it.
  billing_account=$(gcloud billing projects describe "$PROJECT_ID" --format='value(billingAccountName)')
  billing_account=${billing_account#billingAccounts/}
  step "Billing account $billing_account: the deploy manages the stacks' budgets (needs you to administer it)"
  gcloud billing accounts add-iam-policy-binding "$billing_account" --member="$(member gft-ci-deploy)" \
    --role=roles/billing.costsManager --quiet >/dev/null
fi
if $has_cloud_build; then
  grant_project gft-ci-deploy roles/cloudbuild.builds.editor
fi
if $has_cloud_run_cloud_build; then
  grant_project gft-ci-deploy "$custom/gftCiProjectIamGranter" "$(grants_only roles/logging.logWriter)" \
    gft-ci-grant-build-log-role
fi

# ---------------------------------------------------------------------------------------- per stack
# Every account the program uses exists before the first `pulumi up`, which adopts it, so the deploy
# identity needs actAs / setIamPolicy on these accounts only, never project-wide. The display names are the
# program's (infra/foundation.py account_display_name). The builder account is created for every stack, so
# switching a stack to imageBuild: cloud-build needs only this script's grants.
while read -r stack workload stack_features; do
  [[ -n "$stack" ]] || continue
  step "Stack $stack ($workload, features: $stack_features): service accounts"
  ensure_account "gft-$stack-train" "gemma-finetune $stack: training workload"
  ensure_account "gft-$stack-build" "gemma-finetune $stack: Cloud Build image builds"
  if [[ "$workload" == cloud-run ]]; then
    # the unreviewed PR preview reads this stack's model bucket by its exact name, no other stack's (ci-identities.yaml)
    model_bucket="projects/_/buckets/$PROJECT_ID-gft-$stack"
    grant_project gft-ci-preview roles/storage.objectViewer \
      "resource.name == '$model_bucket' || resource.name.startsWith('$model_bucket/')" "gft-ci-preview-$stack-objects"
    grant_project gft-ci-preview roles/storage.bucketViewer "resource.name == '$model_bucket'" \
      "gft-ci-preview-$stack-bucket"
    ensure_account "gft-$stack-serve" "gemma-finetune $stack: vLLM serving"
    grant_account gft-ci-deploy roles/iam.serviceAccountUser "$(account "gft-$stack-train")"
    grant_account gft-ci-deploy roles/iam.serviceAccountUser "$(account "gft-$stack-serve")"
  else
    # a deployed stack's preview lists its run's completion marker (infra/foundation.py finished_run): its bucket only
    model_bucket="projects/_/buckets/$PROJECT_ID-gft-$stack"
    grant_project gft-ci-preview-gke roles/storage.objectViewer \
      "resource.name == '$model_bucket' || resource.name.startsWith('$model_bucket/')" "gft-ci-preview-gke-$stack-objects"
    ensure_account "gft-$stack-node" "gemma-finetune $stack: GKE Autopilot nodes"
    grant_account gft-ci-deploy "$custom/gftCiWorkloadIdentityBinder" "$(account "gft-$stack-train")"
    grant_account gft-ci-deploy roles/iam.serviceAccountUser "$(account "gft-$stack-node")"
  fi
  if [[ ",$stack_features," == *,cloud-build,* ]]; then
    grant_account gft-ci-deploy roles/iam.serviceAccountUser "$(account "gft-$stack-build")"
  fi
  if [[ "$STATE_BACKEND" == bucket ]]; then
    # the stack's own key: decrypt for the identities that run this stack's workload, and no other
    ensure_key "$(stack_key "$stack")"
    readers=(gft-ci-deploy-preview gft-ci-deploy)
    if [[ "$workload" == cloud-run ]]; then readers+=(gft-ci-preview); else readers+=(gft-ci-preview-gke); fi
    for reader in "${readers[@]}"; do grant_key "$reader" "$(stack_key "$stack")"; done
  fi
done <<<"$STACK_LINES"

# ---------------------------------------------------------------------------------------- stacks
# Bucket backend: every stack on its KMS key. `pulumi stack init` on a bucket backend picks the passphrase
# provider unless told otherwise, and CI has no passphrase (it would fail every preview and deploy), so the
# setup creates a missing stack with --secrets-provider, and moves a stack on a passphrase or another key to
# its own with `pulumi stack change-secrets-provider` (it decrypts with the old provider: a passphrase stack
# asks for it, or reads PULUMI_CONFIG_PASSPHRASE; pulumi docs, "pulumi stack change-secrets-provider").
# Either rewrites Pulumi.<stack>.yaml (secretsprovider, encryptedkey): commit it.
stack_file_provider() { # the secretsprovider line of Pulumi.<stack>.yaml, "passphrase" for encryptionsalt, or ""
  local file="$REPO_ROOT/Pulumi.$1.yaml"
  if grep -q '^encryptionsalt:' "$file" 2>/dev/null; then
    echo passphrase
  else
    sed -n 's/^secretsprovider:[[:space:]]*//p' "$file" 2>/dev/null | head -n 1
  fi
}
changed_stack_files=()
if [[ "$STATE_BACKEND" == bucket ]]; then
  step "Stacks on their KMS keys (backend gs://$STATE_BUCKET)"
  if ! command -v "$PULUMI" >/dev/null 2>&1; then
    echo "The Pulumi CLI ($PULUMI) is not on PATH: create or move each stack yourself, then commit Pulumi.<stack>.yaml:"
    while read -r stack _; do
      [[ -n "$stack" ]] || continue
      echo "  PULUMI_BACKEND_URL=gs://$STATE_BUCKET pulumi stack init $stack --secrets-provider $(secrets_provider "$stack")"
      echo "    (an existing stack: pulumi stack change-secrets-provider --stack $stack $(secrets_provider "$stack"))"
    done <<<"$STACK_LINES"
  else
    existing=$(cd "$REPO_ROOT" && PULUMI_BACKEND_URL="gs://$STATE_BUCKET" "$PULUMI" stack ls --json --non-interactive)
    while read -r stack _; do
      [[ -n "$stack" ]] || continue
      provider=$(secrets_provider "$stack")
      if ! python3 -c 'import json, sys; names = {s["name"].rsplit("/", 1)[-1] for s in json.loads(sys.argv[1] or "[]")}
sys.exit(sys.argv[2] not in names)' "$existing" "$stack"; then
        (cd "$REPO_ROOT" && PULUMI_BACKEND_URL="gs://$STATE_BUCKET" "$PULUMI" stack init "$stack" \
          --secrets-provider "$provider" --non-interactive)
        changed_stack_files+=("Pulumi.$stack.yaml")
      elif [[ "$(stack_file_provider "$stack")" != "$provider" ]]; then
        echo "stack $stack: secrets provider '$(stack_file_provider "$stack")' in Pulumi.$stack.yaml, moving it to $provider"
        (cd "$REPO_ROOT" && PULUMI_BACKEND_URL="gs://$STATE_BUCKET" "$PULUMI" stack change-secrets-provider \
          --stack "$stack" "$provider")
        changed_stack_files+=("Pulumi.$stack.yaml")
      fi
    done <<<"$STACK_LINES"
  fi
fi

# ---------------------------------------------------------------------------------------- stale grants
# The setup adds bindings; one it made for a stack, a workload or a key that is gone would stay. Every binding of
# a CI identity on the project, the state bucket, the key ring's keys and the stacks' service accounts that this
# run did not make is reported, and removed with PRUNE=1.
# shellcheck disable=SC2016  # a Python program, not a shell expansion
STALE_PY='
import json, re, sys
made_file, kind, target, project = sys.argv[1:5]
norm = lambda text: " ".join(text.split())
made = set()
for line in open(made_file):
    k, t, member, role, expression = line.rstrip("\n").split("\t")
    if (k, t) == (kind, target):
        made.add((member, role, norm(expression)))
ci = re.compile(r"serviceAccount:gft-ci-[a-z0-9-]+@" + re.escape(project) + r"\.iam\.gserviceaccount\.com")
for binding in json.load(sys.stdin).get("bindings") or []:
    condition = binding.get("condition") or {}
    for member in binding.get("members") or []:
        if ci.fullmatch(member) and (member, binding["role"], norm(condition.get("expression", ""))) not in made:
            print("\t".join([binding["role"], member, norm(condition.get("expression", "")), condition.get("title", "")]))
'
stale=0
check_stale() { # KIND TARGET: what the CI identities hold there beyond this run's bindings
  local kind="$1" target="$2" policy role who expression title
  local where=()
  case "$kind" in
    project) policy=$(gcloud projects get-iam-policy "$target" --format=json) ;;
    bucket) policy=$(gcloud storage buckets get-iam-policy "$target" --format=json) ;;
    key)
      where=(--keyring="$KMS_KEYRING" --location="$KMS_LOCATION" --project="$PROJECT_ID")
      policy=$(gcloud kms keys get-iam-policy "$target" "${where[@]}" --format=json)
      ;;
    account)
      where=(--project="$PROJECT_ID")
      policy=$(gcloud iam service-accounts get-iam-policy "$target" "${where[@]}" --format=json)
      ;;
  esac
  while IFS=$'\t' read -r role who expression title; do
    [[ -n "$role" ]] || continue
    stale=$((stale + 1))
    echo "  not in ci-identities.yaml: $kind $target: $who $role${expression:+ if $expression}"
    if [[ "$PRUNE" == 1 ]]; then
      local conditioned=()
      if [[ -n "$expression" ]]; then
        conditioned=(--condition="^;^expression=$expression;title=$title")
      elif [[ "$kind" == project ]]; then
        conditioned=(--condition=None)
      fi
      local group=(projects)
      case "$kind" in
        bucket) group=(storage buckets) ;;
        key) group=(kms keys) ;;
        account) group=(iam service-accounts) ;;
      esac
      gcloud "${group[@]}" remove-iam-policy-binding "$target" "${where[@]}" --member="$who" --role="$role" \
        "${conditioned[@]}" --quiet >/dev/null
    fi
  done < <(python3 -c "$STALE_PY" "$made_grants" "$kind" "$target" "$PROJECT_ID" <<<"${policy:-{\}}")
}
step "Grants of the CI identities that ci-identities.yaml no longer lists"
check_stale project "$PROJECT_ID"
if [[ "$STATE_BACKEND" == bucket ]]; then
  check_stale bucket "gs://$STATE_BUCKET"
  for key in $(gcloud kms keys list --keyring="$KMS_KEYRING" --location="$KMS_LOCATION" --project="$PROJECT_ID" \
    --format='value(name)'); do
    check_stale key "${key##*/}"
  done
fi
for email in $(gcloud iam service-accounts list --project="$PROJECT_ID" --format='value(email)'); do
  [[ "$email" == gft-* && "$email" != gft-ci-* ]] && check_stale account "$email"
done
if ((stale == 0)); then
  echo "  none"
elif [[ "$PRUNE" == 1 ]]; then
  echo "  removed the $stale binding(s) above"
else
  echo "  $stale binding(s) above: rerun with PRUNE=1 to remove them"
fi

# ---------------------------------------------------------------------------------------- GitHub
backend_line="variable PULUMI_ORG=<your Pulumi Cloud organisation>; one team per trust level (docs/ci.md, Pulumi Cloud): with an OIDC issuer the variables PULUMI_PREVIEW_TEAM, PULUMI_PREVIEW_GKE_TEAM, PULUMI_DEPLOY_PREVIEW_TEAM, PULUMI_DEPLOY_TEAM, else environment secrets PULUMI_PREVIEW_ACCESS_TOKEN (preview: read Cloud Run stacks), PULUMI_PREVIEW_GKE_ACCESS_TOKEN (preview-gke: read GKE stacks), PULUMI_DEPLOY_PREVIEW_ACCESS_TOKEN (deploy-preview: read every stack), PULUMI_ACCESS_TOKEN (deploy and destroy: write)"
if [[ "$STATE_BACKEND" == bucket ]]; then
  backend_line="variable PULUMI_BACKEND_URL=gs://$STATE_BUCKET (no secret: each stack uses --secrets-provider gcpkms://$KEYRING_NAME/cryptoKeys/gft-<stack>)"
fi
cat <<EOF

Done. In GitHub ($GITHUB_REPO), Settings:
  Secrets and variables > Actions > Variables: GCP_PROJECT_ID=$PROJECT_ID  GCP_PROJECT_NUMBER=$PROJECT_NUMBER
  State backend: $backend_line
  Environments: preview-gke, deploy, destroy, each with Required reviewers (see docs/ci.md for the GitHub plans);
    deploy, destroy and deploy-preview (no reviewers): Deployment branches = main only (a pull request's job must
    not reach their secrets); preview (no reviewers, no branch rule) holds only the Cloud Run previews' token
New stacks: commit Pulumi.<stack>.yaml and rerun this script: it creates the stack on its own key (bucket backend).
EOF
if ((${#changed_stack_files[@]})); then
  echo "Commit the stack files this run wrote (their secretsprovider and encryptedkey): ${changed_stack_files[*]}"
fi
