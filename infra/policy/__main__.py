"""The gemma-finetune guard-rail pack: `pulumi preview --policy-pack infra/policy` (CI: `policyPacks`).

Only constructs the pack. The policies live in `policies.py`, which the tests import; importing
this file would start the policy server and serve for ever.
"""

import sys
from pathlib import Path

from pulumi_policy import EnforcementLevel, PolicyPack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policies import resource_policies

PolicyPack(
    name="gemma-finetune-guardrails",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=resource_policies(),
)
