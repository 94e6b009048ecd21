"""The offline tools beside the program: `pulumi up` never imports this package.

- `engine`: runs the program under Pulumi mocks (tests, `make plan`, the permission proof)
- `plan`: `make plan`, the table and manifests of a stack before any resource exists
- `validate_manifests`: `make lint`, every planned manifest against Kubernetes and KubeRay schemas
- `permissions`, `api_permissions`, `iam_roles.json`: the permission proof and its role data
- `schemas/`: the KubeRay CRD schema the validation reads
"""
