"""Wait, during `pulumi up`, until a cluster's CustomResourceDefinitions are Established.

Decisions
- The GKE Ray operator add-on installs `rayjobs.ray.io` and `rayclusters.ray.io` itself, at a time
  no document states (GKE docs, add-on/ray-on-gke/how-to/enable-ray-on-gke, say nothing of it). pulumi-kubernetes retries the create of an object whose kind
  the API server does not know yet for about a minute only, and `customTimeouts` cover only the await
  after a create (pulumi/pulumi-kubernetes provider/pkg/await). So a pulumi-command step runs `kubectl` on the machine that runs
  `pulumi up`: it polls until each CRD exists, then `kubectl wait --for=condition=Established` (the
  condition the API server sets once it serves the kind). The Ray objects depend on this step.
- Not pulumi-kubernetes' `pulumi.com/waitFor` annotation (v4.18+, pulumi/pulumi-kubernetes#3134): it
  makes Pulumi wait on an object Pulumi itself creates or patches. The add-on owns these CRDs; hanging
  an annotation on them would mean writing to a Google-managed object. Not
  `CustomResourceDefinition.get`: a read happens once, and fails while the CRD is still absent.
- The kubeconfig travels as a secret environment value and is written to a private temporary file
  that is removed on exit; it holds no credential (`infra.gke`: gke-gcloud-auth-plugin).
- Needs, on the machine that runs `pulumi up`: bash, `kubectl` and `gke-gcloud-auth-plugin`
  (`gcloud components install kubectl gke-gcloud-auth-plugin`; in CI, deploy.yml's apply job installs
  them, `.ci/stacks.py --components`). A preview does not run it (pulumi/pulumi-command
  provider/pkg/provider/local/commandController.go: "If in preview, don't run the command"); a later
  `up` runs it again only when one of its inputs changes (the cluster's kubeconfig, the CRD list, the
  script). The identity needs container.customResourceDefinitions.get and .list (infra/offline/api_permissions.py).

Not here: waiting for the KubeRay operator itself (Google runs it; an Established CRD is what the API
server needs to accept a RayJob, which the operator then picks up whenever it is ready).
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
