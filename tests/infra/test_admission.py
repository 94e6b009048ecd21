"""The preview fence (infra/admission.py): its CEL replayed on admission requests, and its place in every GKE plan.

The ValidatingAdmissionPolicy's match condition and validation are evaluated here with cel-python on the
AdmissionRequest a Kubernetes API server hands a policy (admission.k8s.io/v1 AdmissionRequest: `userInfo.username`,
`operation`, `dryRun`; a CONNECT such as exec carries no `dryRun`). An API server runs the validations only when every
match condition is true, and refuses the request when a validation is false (failurePolicy Fail: also on an error).
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest
import yaml

from infra import admission
from infra.offline.engine import StackRun
from infra.offline.permissions import CI_DEPLOY, CI_DEPLOY_PREVIEW, CI_PREVIEW_GKE, ci_identities, permissions_of
from infra.offline.validate_manifests import validate_document
from tests.infra.conftest import Variant
from tests.infra.test_ordering import ancestors, dependency_graph

PROJECT = "my-gcp-project"


def _evaluate(expression: str, request: dict[str, Any]) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    result = program.evaluate({"request": celpy.json_to_cel(request)})
    assert isinstance(result, celpy.celtypes.BoolType), (expression, result)
    return bool(result)


def admitted(request: dict[str, Any], project: str = PROJECT) -> bool:
    """What the API server decides with the fence in force."""
    spec = admission.render_policy(project)
    if not all(_evaluate(c["expression"], request) for c in spec["matchConditions"]):
        return True
    return all(_evaluate(v["expression"], request) for v in spec["validations"])


def request(account: str, operation: str, resource: str, dry_run: bool | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "operation": operation,
        "resource": {"group": "", "version": "v1", "resource": resource.split("/")[0]},
        "namespace": "gft-ray-gemma3-vision",
        "userInfo": {"username": f"{account}@{PROJECT}.iam.gserviceaccount.com", "groups": ["system:authenticated"]},
    }
    if "/" in resource:
        body["subResource"] = resource.split("/", 1)[1]
    if dry_run is not None:
        body["dryRun"] = dry_run
    return body


class TestTheRule:
    @pytest.mark.parametrize("account", [CI_PREVIEW_GKE, CI_DEPLOY_PREVIEW])
    def test_a_preview_may_dry_run_a_write(self, account: str) -> None:
        for operation in ("CREATE", "UPDATE", "DELETE"):
            assert admitted(request(account, operation, "pods", dry_run=True)), operation

    @pytest.mark.parametrize("account", [CI_PREVIEW_GKE, CI_DEPLOY_PREVIEW])
    @pytest.mark.parametrize(
        ("operation", "resource", "dry_run"),
        [
            ("CREATE", "pods", False),
            ("CREATE", "pods", None),
            ("CREATE", "serviceaccounts/token", None),
            ("CONNECT", "pods/exec", None),
            ("CONNECT", "pods/portforward", None),
            ("CONNECT", "services/proxy", None),
            ("DELETE", "networkpolicies", False),
            ("UPDATE", "serviceaccounts", False),
        ],
    )
    def test_a_preview_makes_no_write(self, account: str, operation: str, resource: str, dry_run: bool | None) -> None:
        assert not admitted(request(account, operation, resource, dry_run))

    @pytest.mark.parametrize("account", [CI_PREVIEW_GKE, CI_DEPLOY_PREVIEW])
    @pytest.mark.parametrize(
        ("operation", "resource"),
        [
            # kubernetes pkg/registry/core/serviceaccount/storage/token.go `TokenREST.Create` never reads
            # options.DryRun: a dry-run TokenRequest returns a signed token all the same
            ("CREATE", "serviceaccounts/token"),
            ("CREATE", "pods/eviction"),
            ("UPDATE", "pods/ephemeralcontainers"),
            ("CREATE", "pods/binding"),
        ],
    )
    def test_no_subresource_even_as_a_dry_run(self, account: str, operation: str, resource: str) -> None:
        """A dry run is only as dry as the storage behind it; a preview dry-runs whole objects, never a subresource."""
        assert not admitted(request(account, operation, resource, dry_run=True))

    def test_the_deploy_and_everyone_else_are_not_its_business(self) -> None:
        assert admitted(request(CI_DEPLOY, "CREATE", "pods", dry_run=False))
        assert admitted(request("someone", "CONNECT", "pods/exec", dry_run=None))
        # another project's preview identity is another principal
        assert admitted(request(CI_PREVIEW_GKE, "CREATE", "pods", dry_run=False), project="other-project")

    def test_it_matches_every_write_and_connect_on_every_resource(self) -> None:
        [rule] = admission.render_policy(PROJECT)["matchConstraints"]["resourceRules"]
        assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE", "CONNECT"}
        assert rule["resources"] == ["*", "*/*"] and rule["apiGroups"] == ["*"] and rule["apiVersions"] == ["*"]
        assert admission.render_policy(PROJECT)["failurePolicy"] == "Fail"

    def test_it_prints_the_fence_for_another_cluster_of_the_project(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert admission.main([PROJECT]) == 0
        assert list(yaml.safe_load_all(capsys.readouterr().out)) == admission.render_fence(PROJECT)
        assert admission.main([]) == 2

    def test_the_manifests_are_valid_kubernetes_objects(self) -> None:
        documents = [*admission.render_fence(PROJECT), admission.render_fence_role()]
        for document in yaml.safe_load_all(yaml.safe_dump_all(documents)):
            outcome = validate_document(document, document["kind"])
            assert outcome.status == "valid", outcome

    def test_it_fences_every_ci_identity_that_may_write_in_the_cluster_for_a_dry_run_only(self) -> None:
        """The identities whose Kubernetes write verbs exist for dry runs (ci-identities.yaml: container.developer
        'for: server-side dry run') are exactly the fenced ones; the deploy writes for real."""
        writers = set()
        for name, identity in ci_identities()["identities"].items():
            for grant in identity["grants"]:
                if "container.pods.create" in permissions_of(grant["role"], name) and "dry run" in grant["for"]:
                    writers.add(name)
        assert writers == set(admission.PREVIEW_ACCOUNTS)


class TestEveryGkePlan:
    def test_the_fence_comes_before_the_namespace_and_names_the_preview_identities(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        gke = [(v, r) for v, r in user_variant_runs if r.cfg is not None and r.cfg.workload.value.startswith("gke")]
        assert gke
        for variant, run in gke:
            graph = dependency_graph(run)
            fences = [r for r in run.resources if r.type == "command:local:Command" and "preview-fence" in r.name]
            [namespace] = [r for r in run.resources if r.type == "kubernetes:core/v1:Namespace"]
            assert len(fences) == 1, variant.label
            assert fences[0].urn in ancestors(graph, namespace.urn), f"[{variant.label}] the namespace is unfenced"
            environment = fences[0].plain_inputs()["environment"]
            assert environment["PREVIEW_USERNAMES"].split() == admission.preview_usernames(run.cfg.project)
            applied = list(yaml.safe_load_all(environment["FENCE_MANIFEST"]))
            assert applied == admission.render_fence(run.cfg.project), variant.label
