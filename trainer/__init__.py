"""gemma-finetune trainer: one package, recipes that run on a laptop CPU, one GPU,
8 GPUs with FSDP, or under Ray Train.

This module imports nothing heavy: the Pulumi program imports `trainer.recipe` to
validate stack configuration without torch installed.
"""
