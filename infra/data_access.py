"""The trainer's read grant on the user's training data in a bucket (a `gs://` `data.path` / `data.image_dir`).

Decisions
- Exactly what the recipe reads: `roles/storage.objectViewer` on the data's bucket, to the trainer's service
  account (on GKE the trainer's Kubernetes service account acts as it), with an IAM Condition on the object
  prefix when the URL names one (trainer/recipe.py `DataSpec.gcs_read_scopes`). Data in the stack's own
  bucket needs no grant (the trainer already holds objectUser there); Hub and local data need none.
- The condition has two clauses because Cloud Storage checks `storage.objects.get` on the object
  (`resource.name` is `projects/_/buckets/B/objects/NAME`) but `storage.objects.list` on the bucket, where the
  listed prefix is the request attribute `storage.googleapis.com/objectListPrefix` (cloud.google.com/iam/docs/
  conditions-attribute-reference, "Object list prefix"). A glob lists its folder (fsspec's glob lists the
  directory above the first wildcard: fsspec/spec.py `AbstractFileSystem.glob` -> `find(root)`), so listing
  is allowed under the prefix's folder and reading under the prefix itself: `gs://b/t/train-*.jsonl` may list
  names under `t/` and read objects whose names start with `t/train-`.
- One data bucket per recipe (infra/config.py refuses two): one grant, one scope in the permission proof.
- Who may make the grant: the stack's deploy identity administers buckets named `PROJECT-gft-*` only
  (infra/bootstrap/ci-identities.yaml). Data in such a bucket is granted by CI; any other bucket needs a
  `pulumi up` by someone who administers that bucket (the permission proof reports the deploy's gap).
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


def read_condition(bucket: str, prefix: str) -> str | None:
    """The IAM Condition that limits the read grant to `prefix`; None for the whole bucket."""
    if not prefix:
        return None
    listed = list_prefix(prefix)
    return (
        f"resource.name.startsWith('{object_resource(bucket, prefix)}') || "
        f"api.getAttribute('storage.googleapis.com/objectListPrefix', '').startsWith('{listed}')"
    )
