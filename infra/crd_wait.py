"""Wait, during `pulumi up`, until a cluster's CustomResourceDefinitions are Established.

Decisions (why and sources: docs/gke.md#waiting-for-the-ray-crds-with-kubectl)
- The GKE Ray operator add-on installs the Ray CRDs on its own schedule, and pulumi-kubernetes retries
  an unknown kind for about a minute only: so a pulumi-command step runs `kubectl` where `pulumi up`
  runs, polls until each CRD exists, then `kubectl wait --for=condition=Established`.
- Not `pulumi.com/waitFor` (it would annotate a Google-managed object), not a one-time read.
- The kubeconfig (no credential in it) goes to a private temporary file, removed on exit.
- Needs bash, `kubectl` and `gke-gcloud-auth-plugin` on that machine; a preview does not run it.
Not here: waiting for the KubeRay operator itself (an Established CRD is what the API server needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_command as command

# The kinds the GKE Ray operator add-on serves that this program creates (KubeRay's CRD names: <plural>.<group>).
KUBERAY_CRDS = ("rayjobs.ray.io", "rayclusters.ray.io")
WAIT_SECONDS = 15 * 60
POLL_SECONDS = 10

WAIT_SCRIPT = """set -euo pipefail
command -v kubectl >/dev/null || {
  echo "kubectl is needed to wait for $CRDS: gcloud components install kubectl gke-gcloud-auth-plugin" >&2
  exit 1
}
umask 077
kubeconfig=$(mktemp)
trap 'rm -f "$kubeconfig"' EXIT
printf '%s' "$KUBECONFIG_DATA" > "$kubeconfig"
export KUBECONFIG="$kubeconfig"
deadline=$(( $(date +%s) + WAIT_SECONDS ))
for crd in $CRDS; do
  until last=$(kubectl get crd "$crd" -o name 2>&1); do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "crd/$crd did not appear within ${WAIT_SECONDS}s (last answer: $last)." >&2
      echo "Check the add-on: kubectl get crd | grep ray.io; then run pulumi up again." >&2
      exit 1
    fi
    sleep "$POLL_SECONDS"
  done
done
remaining=$(( deadline - $(date +%s) ))
if [ "$remaining" -lt 1 ]; then remaining=1; fi
for crd in $CRDS; do
  kubectl wait --for=condition=Established "crd/$crd" --timeout="${remaining}s" >&2
done
printf 'established: %s' "$CRDS"
"""


@dataclass
class CrdWaitArgs:
    kubeconfig: pulumi.Input[str]
    """The cluster's kubeconfig (a secret Output of `infra.gke.AutopilotCluster`)."""
    crds: tuple[str, ...]
    """CRD names to wait for, `<plural>.<group>`."""
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    """The cluster (and whatever installs the CRDs)."""
    wait_seconds: int = WAIT_SECONDS
    """How long the CRDs may take to appear and become Established, in total."""


class CrdWait(pulumi.ComponentResource):
    """One pulumi-command step that returns once every CRD in `crds` is Established."""

    command: command.local.Command
    """Depend on this: it is created only once the CRDs are Established."""

    def __init__(self, name: str, args: CrdWaitArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:CrdWait", name, None, opts)
        self.command = command.local.Command(
            f"{name}-crds",
            create=WAIT_SCRIPT,
            interpreter=["/bin/bash", "-c"],
            environment={
                "KUBECONFIG_DATA": pulumi.Output.secret(args.kubeconfig),
                "CRDS": " ".join(args.crds),
                "WAIT_SECONDS": str(args.wait_seconds),
                "POLL_SECONDS": str(POLL_SECONDS),
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        self.register_outputs({"crds": " ".join(args.crds)})
