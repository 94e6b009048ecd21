"""gemma-finetune's Pulumi program: one module per concern (see infra/README.md)."""
