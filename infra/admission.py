"""The admission rule in each GKE cluster: the CI preview identities may dry-run every write, and make none.

A server-side dry run is authorized as the verb it tries, so the GKE preview identities hold container.developer:
pods, exec, port-forward, tokens, and through Workload Identity the trainer's bucket. This ValidatingAdmissionPolicy
(admissionregistration.k8s.io/v1, GA in 1.30) refuses every CREATE, UPDATE, DELETE and CONNECT of theirs on any
resource that is not a dry run of a whole object (a dry-run TokenRequest still mints a token); reads never reach
admission. GKE names a Google service account by its email.
- Applied by `kubectl apply` in `pulumi up` (a pulumi-command step, never in a preview): a Pulumi-managed policy would
  be dry-run by every preview, and no preview may write admission policies (no admission rule guards them).
- GKE's IAM has no permission on admission policies: the step binds itself, through RBAC, a ClusterRole that may
  manage them (the deploy's custom role gftCiAdmissionFenceApplier: clusterRoles escalate and bind).
- The training namespace waits for it; the cluster's deletion removes it.
Evidence and what it costs: docs/ci.md, "What a pull request can do"; the CEL replayed in tests/infra/test_admission.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_command as command
import yaml

from infra.config import StackConfig

# The CI identities that hold Kubernetes write verbs for dry runs only (infra/bootstrap/ci-identities.yaml).
PREVIEW_ACCOUNTS = ("gft-ci-preview-gke", "gft-ci-deploy-preview")
POLICY_NAME = "gft-ci-previews-dry-run-only"
# Which requests the rule looks at: those of a preview identity. `request.dryRun` is false (or unset) on a CONNECT.
MATCH_EXPRESSION = "request.userInfo.username in {usernames}"
# A dry run of a whole object only: a dry run is as dry as the storage behind it, and some subresources ignore it
# (kubernetes pkg/registry/core/serviceaccount/storage/token.go `TokenREST.Create` never reads options.DryRun, so a
# dry-run TokenRequest returns a signed token). pulumi-kubernetes previews whole objects, never a subresource.
VALIDATION_EXPRESSION = (
    "has(request.dryRun) && request.dryRun == true && (!has(request.subResource) || request.subResource == '')"
)
MESSAGE = (
    "CI preview identities may only dry-run whole objects (kubectl --dry-run=server, pulumi preview): "
    "infra/admission.py, docs/ci.md 'What a pull request can do'"
)


def preview_usernames(project: str) -> list[str]:
    """The Kubernetes usernames of the preview identities in this project's clusters (their emails)."""
    return [f"{account}@{project}.iam.gserviceaccount.com" for account in PREVIEW_ACCOUNTS]


def match_expression(project: str) -> str:
    listed = ", ".join(f"'{username}'" for username in preview_usernames(project))
    return MATCH_EXPRESSION.format(usernames=f"[{listed}]")


def render_policy(project: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy's spec as plain values (what the tests evaluate)."""
    return {
        "failurePolicy": "Fail",
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": ["*"],
                    "apiVersions": ["*"],
                    "operations": ["CREATE", "UPDATE", "DELETE", "CONNECT"],
                    "resources": ["*", "*/*"],
                    "scope": "*",
                }
            ]
        },
        "matchConditions": [{"name": "preview-identity", "expression": match_expression(project)}],
        "validations": [{"expression": VALIDATION_EXPRESSION, "message": MESSAGE, "reason": "Forbidden"}],
    }


# The RBAC the step binds to whoever runs it, so that the policy can be applied at all.
FENCE_ROLE = "gft-admission-fence-writer"
FENCE_RULES = [
    {
        "apiGroups": ["admissionregistration.k8s.io"],
        "resources": ["validatingadmissionpolicies", "validatingadmissionpolicybindings"],
        "verbs": ["get", "list", "watch", "create", "update", "patch"],
    }
]


def render_fence(project: str) -> list[dict[str, Any]]:
    """The policy and its binding (Deny), as the step applies them."""
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": POLICY_NAME},
            "spec": render_policy(project),
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": POLICY_NAME},
            "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
        },
    ]


def render_fence_role() -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": FENCE_ROLE},
        "rules": FENCE_RULES,
    }


FENCE_SCRIPT = """set -euo pipefail
command -v kubectl >/dev/null || {
  echo "kubectl is needed to apply the preview fence: gcloud components install kubectl gke-gcloud-auth-plugin" >&2
  exit 1
}
umask 077
kubeconfig=$(mktemp)
trap 'rm -f "$kubeconfig"' EXIT
printf '%s' "$KUBECONFIG_DATA" > "$kubeconfig"
export KUBECONFIG="$kubeconfig"
me=$(kubectl auth whoami -o jsonpath='{.status.userInfo.username}')
printf '%s' "$FENCE_ROLE_MANIFEST" | kubectl apply --server-side --force-conflicts --field-manager=gemma-finetune -f - >&2
kubectl create clusterrolebinding "$FENCE_ROLE" --clusterrole="$FENCE_ROLE" --user="$me" \
  --dry-run=client -o yaml | kubectl apply --server-side --force-conflicts --field-manager=gemma-finetune -f - >&2
# RBAC takes effect at once on the API server; a few tries cover a second API server replica catching up
for try in 1 2 3 4 5 6; do
  if printf '%s' "$FENCE_MANIFEST" | kubectl apply --server-side --force-conflicts --field-manager=gemma-finetune -f - >&2; then
    printf 'fenced: %s' "$PREVIEW_USERNAMES"
    exit 0
  fi
  sleep $((try * 5))
done
echo "the preview fence could not be applied (above); nothing after it was created. Run pulumi up again." >&2
exit 1
"""


@dataclass
class PreviewFenceArgs:
    cfg: StackConfig
    """The validated stack configuration (its project names the identities)."""
    kubeconfig: pulumi.Input[str]
    """The cluster's kubeconfig (a secret Output of `infra.gke.AutopilotCluster`; no credential in it)."""
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    """The cluster."""


class PreviewFence(pulumi.ComponentResource):
    """One pulumi-command step that applies the admission policy keeping the preview identities to dry runs."""

    command: command.local.Command
    """Depend on this: it is created only once the policy is in force."""

    def __init__(self, name: str, args: PreviewFenceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:PreviewFence", name, None, opts)
        environment: dict[str, pulumi.Input[str]] = {
            "KUBECONFIG_DATA": pulumi.Output.secret(args.kubeconfig),
            "FENCE_ROLE": FENCE_ROLE,
            "FENCE_ROLE_MANIFEST": yaml.safe_dump(render_fence_role(), sort_keys=False),
            "FENCE_MANIFEST": yaml.safe_dump_all(render_fence(args.cfg.project), sort_keys=False),
            "PREVIEW_USERNAMES": " ".join(preview_usernames(args.cfg.project)),
        }
        self.command = command.local.Command(
            f"{name}-preview-fence",
            create=FENCE_SCRIPT,
            update=FENCE_SCRIPT,
            interpreter=["/bin/bash", "-c"],
            environment=environment,
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        self.register_outputs({"policy": POLICY_NAME})


def main(argv: list[str]) -> int:
    """Print the fence for another cluster of the project (`python -m infra.admission PROJECT | kubectl apply -f -`):
    Workload Identity maps a namespace/KSA of ANY cluster in the project to the same Google principal."""
    if len(argv) != 1:
        print("usage: python -m infra.admission PROJECT_ID", file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(render_fence(argv[0]), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
