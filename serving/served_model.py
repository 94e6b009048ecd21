"""What a stack serves of its runs, and on which GPU: the adapter on the staged base, or the merged export.

    from serving.served_model import served_model
    served_model(recipe, base_staged=True).artefact        # "adapter" for text-to-sql-gemma4-31b

Decision (docs/serving.md, "Adapters, not copies"): vLLM serves the base once and each run's LoRA adapter on it
(`--enable-lora`), so a new run adds megabytes and runs can be compared side by side. The merged export stays where
the adapter cannot be served that way (`MERGE_REASONS`): no base staged in the bucket, an adapter with
`modules_to_save` (vLLM refuses it), an architecture without vLLM LoRA. A QLoRA adapter alone is no reason: the merge
reloads the base in bf16 too (trainer/export.py), so merged and adapter-on-bf16-base compute the same product.
Standard library and the memory model only: config validation uses it in the Pulumi program.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.memory import SERVING_GPUS, ServedMemory, served_memory
from serving.vllm_args import ALLOWED_LORA_RANKS, VLLM_LORA_ARCHITECTURES

if TYPE_CHECKING:
    from trainer.recipe import Recipe

MERGED, ADAPTER = "merged", "adapter"
VLLM_VERSION = "v0.28.0"  # the release serving/vllm_args.py VLLM_IMAGE pins
MERGE_REASONS = {
    "no_staged_base": "the run writes to a mounted folder, where no base is staged (trainer/base_weights.py stages it "
    "only for a gs:// output.dir): an adapter would need its base from the Hub",
    "modules_to_save": "the adapter carries whole copies of {modules} (lora.modules_to_save), which vLLM refuses "
    f"('vLLM only supports modules_to_save being None', vllm/lora/peft_helper.py, {VLLM_VERSION})",
    "architecture": f"vLLM {VLLM_VERSION} has no LoRA for {{architecture}} (no SupportsLoRA in vllm/model_executor/models)",
    "vision_tower": "the adapter also trains the vision tower (lora.vision_tower), which vLLM applies only with "
    f"--enable-tower-connector-lora, not confirmed for Gemma 3 at {VLLM_VERSION}: the merged export answers as trained",
}
ADAPTER_WHY = "vLLM serves LoRA adapters for this architecture and the run stages its base in the bucket"


def served_architecture(name: str) -> str | None:
    """The class vLLM loads for a Gemma checkpoint (its config.json `architectures`), from the checkpoint's name:
    the Gemma 3 sizes from 4B up and Gemma 4 are multimodal checkpoints, Gemma 3 1B and 270M text only."""
    lowered = name.lower()
    if re.search(r"gemma-?4", lowered):
        return "Gemma4ForConditionalGeneration"
    if re.search(r"gemma-?3-(4|12|27)b", lowered):
        return "Gemma3ForConditionalGeneration"
    if re.search(r"gemma-?3", lowered):
        return "Gemma3ForCausalLM"
    return None


def merge_reason(recipe: Recipe, base_staged: bool) -> str | None:
    """Why the merged export is served instead of the adapter, or None when the adapter is."""
    if not base_staged:
        return MERGE_REASONS["no_staged_base"]
    if recipe.lora.modules_to_save:
        return MERGE_REASONS["modules_to_save"].format(modules=", ".join(recipe.lora.modules_to_save))
    if recipe.lora.vision_tower:
        return MERGE_REASONS["vision_tower"]
    architecture = served_architecture(recipe.model.name_or_path)
    if architecture not in VLLM_LORA_ARCHITECTURES:
        return MERGE_REASONS["architecture"].format(architecture=architecture or recipe.model.name_or_path)
    return None


def lora_rank_for(r: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds rank `r` (its largest when none does)."""
    return next((allowed for allowed in ALLOWED_LORA_RANKS if allowed >= r), ALLOWED_LORA_RANKS[-1])


@dataclass(frozen=True)
class ServedModel:
    """What the service loads for a recipe's runs."""

    artefact: str
    why: str
    base_model: str
    revision: str | None
    language_model_only: bool
    """A text recipe on a multimodal checkpoint: no image is ever sent, so vLLM skips the encoder (its profiling)."""
    lora_rank: int | None
    adapters: int
    untied_head: bool = False
    """A merged export of an adapter that trained lm_head whole: vLLM loads it as a tensor of its own."""

    def memory(self, gpu: str, max_model_len: int, max_num_seqs: int | None = None) -> ServedMemory:
        """serving/memory.py's estimate of this model on `gpu`."""
        return served_memory(
            self.base_model,
            gpu,
            max_model_len,
            lora_rank=self.lora_rank,
            loras=self.adapters,
            language_model_only=self.language_model_only,
            max_num_seqs=max_num_seqs,
            untied_head=self.untied_head,
        )

    def smallest_gpu(self, max_model_len: int, max_num_seqs: int | None = None) -> str | None:
        """The Cloud Run GPU with the least memory that holds this model at the served context, or None."""
        for gpu in sorted(SERVING_GPUS, key=lambda g: served_memory(self.base_model, g, 1).memory_gb):
            if self.memory(gpu, max_model_len, max_num_seqs).fits:
                return gpu
        return None


def served_model(recipe: Recipe, base_staged: bool, compared_runs: int = 0) -> ServedModel:
    """What the service loads for `recipe`'s runs; `base_staged`: the runs write to a gs:// output.dir."""
    reason = merge_reason(recipe, base_staged)
    architecture = served_architecture(recipe.model.name_or_path) or ""
    adapters = 0 if reason else 1 + compared_runs
    return ServedModel(
        artefact=MERGED if reason else ADAPTER,
        why=reason or ADAPTER_WHY,
        base_model=recipe.model.name_or_path,
        revision=recipe.model.revision,
        language_model_only=recipe.model.text_only and architecture.endswith("ForConditionalGeneration"),
        lora_rank=lora_rank_for(recipe.lora.r) if adapters else None,
        adapters=adapters,
        untied_head=bool(reason) and "lm_head" in recipe.lora.modules_to_save,
    )
