"""Day two: what each change does to a stack that is up, by the providers' own rules (infra/offline/impact.py).

`make impact` plans every change of `CHANGES` on every stack (about a minute) and commits the result
(infra/offline/impact_results.json) and docs/operations.md's table. Here, cheaply: the committed table is the
rendering of the committed results, which were made with the current rules, changes and program; the safety rules hold
on every committed cell; and a representative change of each kind (a setting that moves the pods, one that
only updates, a trainer pull, a new run) is planned again and must give the committed cell. The classifier
itself is checked on real plans, each rule seen failing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from infra.offline import impact
from infra.offline.engine import Recorded, StackRun, run_stack

# Keys that move the stack as a whole (another project or region): everything may be replaced.
MOVES = {"gcp:project", "gcp:region"}
# What no everyday change may replace (short names in the table; `*` marks delete-first).
NEVER_REPLACED = {"cluster", "bucket", "registry", "net", "nodes", "k8s"}
# The Kubernetes objects a replaced cluster must take with it, per stack.
K8S_OBJECTS = {"a4-gemma4": {"ns", "ksa", "hf", "job"}, "ray-gemma3-vision": {"ns", "ksa", "hf", "rayjob"}}


@cache
def results() -> dict[str, Any]:
    return json.loads(impact.RESULTS_FILE.read_text())


def cells() -> list[tuple[impact.Change, str, impact.Row]]:
    by_label = {c.label: c for c in impact.CHANGES}
    return [
        (by_label[entry["label"]], stack, impact.Row(**cell))
        for entry in results()["rows"]
        for stack, cell in entry["cells"].items()
    ]


def base_names(names: list[str]) -> set[str]:
    return {n.rstrip("*") for n in names}


class TestCommittedTable:
    def test_made_with_the_current_rules_and_changes(self) -> None:
        assert results()["rules"] == impact.rules_digest(), "provider_rules.yaml changed: run `make impact`"
        assert results()["changes"] == impact.catalogue_digest(), "impact.CHANGES changed: run `make impact`"

    def test_made_with_the_current_program(self) -> None:
        """The safety rules below read the committed cells: a program changed since they were planned would pass them
        unplanned. Any edit of infra/ or a stack file asks for `make impact`."""
        assert results()["program"] == impact.program_digest(), "the program changed: run `make impact`"

    def test_the_program_digest_sees_an_edit(self, tmp_path: Path) -> None:
        (tmp_path / "infra").mkdir()
        (tmp_path / "infra" / "gke.py").write_text("DESCRIPTION = 'stack'\n")
        (tmp_path / "Pulumi.dev.yaml").write_text("config: {}\n")
        before = impact.program_digest(tmp_path)
        (tmp_path / "infra" / "gke.py").write_text("DESCRIPTION = 'stack and GPU'\n")
        assert impact.program_digest(tmp_path) != before

    def test_the_doc_shows_the_committed_results(self) -> None:
        assert impact.committed_table() == impact.render(results()), "docs/operations.md is stale: run `make impact`"

    def test_every_key_of_the_project_file_has_a_row(self) -> None:
        from tests.infra.test_project_file import DECLARED

        planned = {c.key for c in impact.CHANGES}
        # Serving keys with the same effect as the planned ones (a Cloud Run Service update), secrets' twins, and the
        # keys that only pick images / prices / budgets: each is in `impact.UNPLANNED_KEYS` instead
        # (docs/operations.md#day-two-from-the-providers-own-rules).
        described = set(impact.UNPLANNED_KEYS)
        assert set(DECLARED) - planned - described == set(), "a key with no row and no line in UNPLANNED_KEYS"

    def test_every_change_was_planned(self) -> None:
        failed = [(c.key, s, r.error) for c, s, r in cells() if r.error]
        assert failed == [], failed


class TestSafetyRules:
    """The promises of docs/operations.md, "Day two", over every committed cell."""

    def test_no_everyday_key_replaces_the_cluster_bucket_registry_or_network(self) -> None:
        bad = [
            (c.key, stack, sorted(base_names(r.replaced) & NEVER_REPLACED))
            for c, stack, r in cells()
            if c.key not in MOVES and base_names(r.replaced) & NEVER_REPLACED
        ]
        assert bad == [], bad

    def test_a_replaced_cluster_replaces_every_kubernetes_object(self) -> None:
        seen = 0
        for c, stack, r in cells():
            if "cluster" in base_names(r.replaced):
                seen += 1
                missing = K8S_OBJECTS[stack] - base_names(r.replaced)
                assert not missing, f"{c.key} on {stack} replaces the cluster but keeps {sorted(missing)}"
        assert seen, "the moves replace the cluster: the rule was exercised"

    def test_a_run_starts_or_restarts_only_for_the_changes_that_say_so(self) -> None:
        wrong = [(c.key, s, r.run, c.expected_run(s)) for c, s, r in cells() if r.run != c.expected_run(s)]
        assert wrong == [], wrong

    def test_a_paid_run_starts_exactly_for_a_change_of_the_run_inputs(self) -> None:
        """DESIGN.md: a new recipe, new data, new overrides, a new base model (in the recipe) or an explicit request;
        never a trainer pull, a setting of the pods or of serving."""
        run_inputs = {"recipe", "recipeOverrides", "runGeneration"}

        def asks(change: impact.Change) -> bool:
            return bool(run_inputs & set(change.overrides)) or change.what_if in ("recipe", "data")

        wrong = [(c.label, s, r.run) for c, s, r in cells() if (r.run == "new run") != asks(c)]
        assert wrong == [], wrong
        assert any(c.what_if == "trainer" for c, _, _ in cells()), "a trainer pull is among the planned changes"


# One change per effect on a run, planned again (the committed cells are `make impact`'s, for this program: see
# TestCommittedTable): pods' placement (restarts), a limit (goes on), a trainer pull, the run's identity (a new run).
# A cluster update and labels are planned in test_cluster_replacement.py and test_lifecycle.py.
REPLANNED = ("capacity", "trainingRetries", "trainer", "runGeneration")


@pytest.fixture(scope="module")
def replanned() -> dict[tuple[str, str], impact.Row]:
    befores: dict[str, StackRun] = {}
    return {
        (c.label, stack): impact.row(c, stack, befores)
        for c in impact.CHANGES
        if c.key in REPLANNED
        for stack in c.stacks
    }


def test_representative_changes_plan_as_committed(replanned: dict[tuple[str, str], impact.Row]) -> None:
    committed = {(c.label, s): r for c, s, r in cells()}
    assert len(replanned) >= 10
    for key, row in replanned.items():
        assert row == committed[key], f"{key}: planned {row.cell()!r}, committed {committed[key].cell()!r}"


class TestClassifier:
    """The rules on real plans of a4-gemma4, each seen failing."""

    @pytest.fixture(scope="class")
    def base(self) -> StackRun:
        return run_stack("a4-gemma4", existing_buckets=("my-gcp-project-gft-a4-gemma4",))

    @staticmethod
    def edited(run: StackRun, typ: str, change: dict[str, Any], **options: Any) -> StackRun:
        """`run` with the inputs of its one resource of type `typ` changed (a plan of the same program otherwise)."""

        def one(r: Recorded) -> Recorded:
            if r.type != typ:
                return r
            return replace(r, inputs={**r.inputs, **change}, **options)

        return replace(run, resources=[one(r) for r in run.resources])

    def test_a_forced_input_replaces_delete_first_when_named(self, base: StackRun) -> None:
        after = self.edited(base, "gcp:container/cluster:Cluster", {"enableAutopilot": False})
        cluster = impact.classify(base, after)[base.one("gcp:container/cluster:Cluster").urn]
        assert (cluster.action, cluster.delete_first) == ("replace", True), cluster
        assert "enableAutopilot: forces replacement" in cluster.reasons[0]

    def test_ignore_changes_leaves_an_input_out(self, base: StackRun) -> None:
        after = self.edited(base, "gcp:container/cluster:Cluster", {"description": "another text"})
        assert impact.classify(base, after)[base.one("gcp:container/cluster:Cluster").urn].action == "unchanged"
        exposed = self.edited(after, "gcp:container/cluster:Cluster", {}, ignore_changes=[])
        assert impact.classify(base, exposed)[base.one("gcp:container/cluster:Cluster").urn].action == "replace"

    def test_a_replaced_parent_makes_its_dependents_inputs_unknown(self, base: StackRun) -> None:
        """The provider's kubeconfig comes from the cluster: a replaced cluster replaces the provider (DiffConfig on
        an unknown kubeconfig), and the provider every object it manages."""
        after = self.edited(base, "gcp:container/cluster:Cluster", {"enableAutopilot": False})
        impacts = impact.classify(base, after)
        assert impacts[base.one("pulumi:providers:kubernetes").urn].action == "replace"
        objects = [r.urn for r in base.resources if r.type.startswith("kubernetes:")]
        assert objects and all(impacts[u].action == "replace" for u in objects)
        assert all("its provider" in impacts[u].reasons[0] for u in objects)

    def test_replace_on_changes_replaces(self, base: StackRun) -> None:
        job = "kubernetes:batch/v1:Job"
        spec = dict(base.one(job).inputs["spec"], backoffLimit=7)
        updated = impact.classify(base, self.edited(base, job, {"spec": spec}))[base.one(job).urn]
        assert updated.action == "update", "backoffLimit is not among a Job's forced fields"
        asked = impact.classify(base, self.edited(base, job, {"spec": spec}, replace_on_changes=["spec"]))
        assert asked[base.one(job).urn].action == "replace"

    def test_a_type_without_rules_is_refused(self, base: StackRun) -> None:
        table = {k: v for k, v in impact.rules().items() if k != "gcp:container/cluster:Cluster"}
        with pytest.raises(KeyError, match="no rule"):
            impact.classify(base, base, table)


def test_every_declared_type_has_a_rule_with_a_source() -> None:
    document = impact.rules_document()
    for typ, rule in impact.rules().items():
        assert rule.source in document["sources"], typ
        assert rule.path, typ
    declared = {r.type for c in ("dev", "a4-gemma4", "ray-gemma3-vision") for r in run_stack(c).resources if r.custom}
    assert declared <= set(impact.rules()), sorted(declared - set(impact.rules()))
