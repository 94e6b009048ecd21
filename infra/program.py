"""The Pulumi program as a function, so every stack can run fresh in one process (tests, `make plan`).

Flow: validated config → preflight → foundation → images → the run (infra/run_identity.py: which one, and whether
this `up` starts a paid one: the `paidRun` output, printed by the preview too) → the workload the stack names →
serving (every stack: infra/serving.py) → outputs (the run's cost ceiling among them) → the budget guard when the
stack sets one → the run's dashboard and alerts.
Bad configuration raises `ConfigError`, and configuration the project cannot serve (a reservation that
is missing or too small, GPU quota below what the run needs, a cost ceiling above `maxRunCostUsd`)
raises `PreflightError`, both before the first resource is declared.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import config as stack_config
from infra import cost, monitoring, preflight, run_identity, serving
from infra.budget import BudgetGuard, BudgetGuardArgs
from infra.config import Workload
from infra.foundation import FINISHED_OUTPUT, Foundation, FoundationArgs, Identity
from infra.images import Images, ImagesArgs


def run() -> dict[str, Any]:
    """Declare the stack's resources; return the stack outputs (the caller exports them)."""
    loaded = stack_config.load()
    cfg = loaded.cfg
    preflight.check(cfg)  # asks the cloud whether the configuration can work, before anything is declared
    verdict = stack_config.stack_memory_verdict(cfg)  # a run that does not fit failed in load(); this one does
    if verdict is not None and verdict.shape is None:  # preflight warn/off let an unknown shape through
        pulumi.log.warn(f"memory per GPU not checked: {verdict.line()}")
    elif verdict is not None:
        pulumi.log.info(f"memory per GPU: {verdict.line()}")
    name = f"gft-{cfg.stack}"

    foundation = Foundation(
        name, FoundationArgs(cfg=cfg, hf_token=loaded.hf_token, serving_api_key=loaded.serving_api_key)
    )
    images = Images(
        name,
        ImagesArgs(
            cfg=cfg,
            registry_url=foundation.registry_url,
            depends_on=[foundation.registry, *foundation.apis, *foundation.grants_to(Identity.BUILD)],
            build_service_account=foundation.build_account.email if foundation.build_account else None,
            staging_bucket=foundation.build_staging_bucket.name if foundation.build_staging_bucket else None,
        ),
    )

    outputs: dict[str, Any] = {
        "workload": str(cfg.workload),
        "recipe": cfg.recipe,
        "bucket": foundation.bucket_uri,
        "bucketOnDestroy": foundation.bucket_uri.apply(
            lambda uri: (
                "deleted with its contents (bucketForceDestroy=true)"
                if cfg.bucket_force_destroy
                else f"kept: `pulumi destroy` leaves {uri} and its models (the next `pulumi up` adopts them); "
                f"delete it with `gcloud storage rm -r {uri}` or set bucketForceDestroy=true and `pulumi up` first"
            )
        ),
        "registry": foundation.registry_url,
        "trainerImage": images.trainer_image,
    }
    if images.serving_image is not None:
        outputs["servingImage"] = images.serving_image

    run = run_identity.resolve(cfg, foundation.bucket_kept, images.trainer_content)
    # The one line a preview shows on whether this `up` starts a paid run, and why (DESIGN.md: a paid run starts only
    # when the user asked for it).
    pulumi.log.info(f"training: {run.line()}")
    outputs["paidRun"] = run.line()
    _add(outputs, _workload(cfg, loaded, foundation, images, run))
    run_identity.declare_record(name, cfg, run, foundation.bucket_name, after=[foundation.bucket])
    _add(outputs, serving.declare(cfg, foundation, images.serving_image, run))
    _add(outputs, cost.outputs(cfg))
    # The run's price, for the cost line the trainer writes into its marker and summary (infra/cost.py); a finished
    # run's folder keeps the price it ran with (its marker's cost line was computed from it).
    run_dir = pulumi.Output.from_input(outputs.get("runDir") or outputs["runUri"])
    if FINISHED_OUTPUT not in outputs:
        cost.declare_price_file(name, cfg, foundation.bucket_name, run_dir, after=[foundation.bucket])
    outputs["costLine"] = run_dir.apply(cost.cost_line_command)
    budget_channels: list[Any] = []
    if cfg.budget_usd is not None:
        budget_channels = BudgetGuard(
            name,
            BudgetGuardArgs(cfg=cfg, project_number=foundation.bucket.project_number, after=list(foundation.apis)),
        ).channels
        # A count, not the addresses: outputs are printed by `pulumi up` and in PR preview comments (infra/budget.py).
        extra = len(cfg.budget_emails)
        recipients = "the billing account's admins" + (f" and {extra} address(es) in budgetEmails" if extra else "")
        outputs["budget"] = (
            f"{cfg.budget_usd} USD a month for resources labelled stack={cfg.stack} in {cfg.project} (billing "
            f"account {cfg.billing_account}); alerts at 50, 90 and 100 % to {recipients}"
        )
    _add(outputs, monitoring.declare(name, cfg, after=list(foundation.apis), budget_channels=budget_channels))
    return outputs


def _add(outputs: dict[str, Any], more: dict[str, Any]) -> None:
    """Add a part's outputs; two parts naming one output would silently hide one of them."""
    clash = sorted(outputs.keys() & more.keys())
    if clash:
        raise AssertionError(f"stack outputs {clash} are declared twice: rename one")
    outputs.update(more)


def _workload(
    cfg: stack_config.StackConfig,
    loaded: stack_config.LoadedConfig,
    foundation: Foundation,
    images: Images,
    run: run_identity.RunState,
) -> dict[str, Any]:
    """Declare the workload the stack names for `run`; each returns its own outputs."""
    if cfg.workload is Workload.CLOUD_RUN:
        from infra import cloud_run

        return cloud_run.declare(cfg, loaded, foundation, images, run)
    if cfg.workload is Workload.GKE_JOB:
        from infra import gke_job

        return gke_job.declare(cfg, loaded, foundation, images, run)
    from infra import ray_job

    return ray_job.declare(cfg, loaded, foundation, images, run)
