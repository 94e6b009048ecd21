"""The trainer's read grant on the user's training data in a bucket (`gs://` sources, `data.eval_path`, `data.image_dir`).

Decisions (why and sources: docs/identities.md#read-access-to-exactly-the-data-prefix)
- Exactly what the recipe reads: `roles/storage.objectViewer` on the data's bucket, to the trainer's
  service account, with an IAM Condition on the object prefix when the URL names one (list under the
  prefix's folder, read under the prefix). The stack's own bucket, Hub and local data need no grant.
- One data bucket per recipe (infra/config.py refuses two), one grant for every prefix in it: a grant per prefix
  lost a binding when the prefixes' order moved it to another resource.
- CI can grant on buckets named `PROJECT-gft-*` only; any other bucket needs a `pulumi up` by someone
  who administers it (the permission proof reports the gap).
"""

from __future__ import annotations

from infra.config import StackConfig
from trainer.recipe import RecipeError, parse_recipe

READ_ROLE = "roles/storage.objectViewer"
CONDITION_TITLE = "gft-training-data"


def data_read_scopes(cfg: StackConfig) -> list[tuple[str, str]]:
    """(bucket, object prefix) the trainer must read, outside the stack's own bucket."""
    from infra.foundation import bucket_name

    try:
        data = parse_recipe(cfg.recipe_source, cfg.recipe_overrides).data
    except RecipeError:
        return []  # config validation reports it
    own = bucket_name(cfg)
    return sorted({(bucket, prefix) for bucket, prefix in data.gcs_read_scopes if bucket != own})


def list_prefix(prefix: str) -> str:
    """The folder a glob under `prefix` lists: up to and with its last '/', or '' (the bucket root)."""
    return prefix[: prefix.rfind("/") + 1]


def object_resource(bucket: str, prefix: str) -> str:
    return f"projects/_/buckets/{bucket}/objects/{prefix}"


def read_condition(bucket: str, prefixes: str | list[str]) -> str | None:
    """The IAM Condition that limits the read grant to the prefixes (each read under itself, listed under its
    folder); None for the whole bucket."""
    prefixes = [prefixes] if isinstance(prefixes, str) else prefixes
    if not all(prefixes):
        return None
    return " || ".join(
        f"resource.name.startsWith('{object_resource(bucket, prefix)}') || "
        f"api.getAttribute('storage.googleapis.com/objectListPrefix', '').startsWith('{list_prefix(prefix)}')"
        for prefix in prefixes
    )


def data_read_grants(cfg: StackConfig) -> list[tuple[str, list[str]]]:
    """One read grant per data bucket, (bucket, every prefix the trainer reads there), in a stable order.

    One grant, not one per prefix: IAM bindings are keyed by their condition, and a grant per prefix named by its
    place in the list moved a prefix's binding to another resource whenever a prefix was added before it; the
    replaced resource's delete then removed the binding (docs/identities.md#read-access-to-exactly-the-data-prefix)."""
    buckets: dict[str, list[str]] = {}
    for bucket, prefix in data_read_scopes(cfg):
        buckets.setdefault(bucket, []).append(prefix)
    return sorted(buckets.items())
