"""The training run's own evaluation, before and after training: `eval` in run_summary.json.

    "eval_loss": 1.02,                       # = eval.after.loss (what older runs hold, the serving gate's fallback)
    "eval": {
      "score": "rouge_l_f1",                 # the headline score: the task's own metric, else ROUGE-L F1
      "generated_rows": 32, "max_new_tokens": 256,
      "before": {"loss": 2.31, "exact_match": 0.0, "rouge_l_f1": 0.12},   # the base model
      "after": {"loss": 1.02, "exact_match": 0.41, "rouge_l_f1": 0.63},   # the tuned one
      "examples": [{"reference": "billing", "before": "Hello! How can", "after": "billing"}, ...]   # 3 rows
    }

Every format gets the held-out loss, exact match and ROUGE-L F1 (trainer/evaluate.py); a tutorial task adds its
own metric (emoji_f1, execution_match; a product description's is ROUGE-L F1).

Decisions:
- Both sides are measured after training, on the one model in memory: "before" is the tuned model with its LoRA
  adapter switched off (peft `PeftModel.disable_adapter()`), which computes the base model (LoRA trains the
  adapter only; the base weights stay frozen); "after" with it on. One load and one sharding: the same code
  for one process, DDP and FSDP, and never a second copy of a 31B model.
- The loss is the trainer's `evaluate()` over the whole eval split (the Trainer shards it over the ranks and
  gathers the result), the number `eval_loss` always was.
- The generated answers are the first `evaluation.generate_rows` held-out rows (`held_out_rows`: the same split,
  never a training row), greedy, up to `max_new_tokens`, in batches of `evaluation.batch_size`; with several ranks
  each answers an even share and the answers are gathered (`sharded_answers`), so every rank holds the same
  numbers and rank 0 writes them. The model is taken out of its wrapper and gradient checkpointing is off while it
  generates (trl `unwrap_model_for_generation`, what trl's own trainers generate with).
- The cost is bounded by `evaluation.generate_rows` (32 by default; the CPU recipes use a few) and
  `evaluation.max_new_tokens`: 2 x generate_rows answers in all.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainer.recipe import Recipe

if TYPE_CHECKING:
    from trl import SFTTrainer

log = logging.getLogger(__name__)

EXAMPLES = 3  # held-out rows whose answers the summary shows, before and after
BEFORE_PREFIX = "eval_before"  # trainer.evaluate's metric prefix for the base model's loss (logged as eval_before_loss)


def run_evaluation(trainer: SFTTrainer, recipe: Recipe, processing_class: Any) -> dict[str, Any] | None:
    """`eval` of the run summary (see the module docstring), or None when the recipe holds out no rows.

    Every rank calls it (the loss and the answers are collectives under DDP and FSDP)."""
    from trl.models.utils import unwrap_model_for_generation

    from trainer.evaluate import held_out_rows, score_name, sharded_answers, text_scores
    from trainer.formatting import prompt_messages, reference_text

    if trainer.eval_dataset is None:
        return None
    task, spec = recipe.data.task, recipe.evaluation
    rows = held_out_rows(recipe, spec.generate_rows) if spec.generate_rows else []
    prompts = [{**conversation, "messages": prompt_messages(conversation)} for conversation, _ in rows]

    answers: dict[str, list[str]] = {}

    def answered(model: Any, side: str) -> dict[str, float]:
        model.eval()
        answers[side] = sharded_answers(model, processing_class, prompts, recipe.max_new_tokens, spec.batch_size)
        return text_scores(task, [(a, c, row) for a, (c, row) in zip(answers[side], rows, strict=True)])

    after: dict[str, Any] = {"loss": trainer.evaluate()["eval_loss"]}
    peft_model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with peft_model.disable_adapter():
        before: dict[str, Any] = {"loss": trainer.evaluate(metric_key_prefix=BEFORE_PREFIX)[f"{BEFORE_PREFIX}_loss"]}
    if prompts:
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            after.update(answered(model, "after"))
            with model.disable_adapter():
                before.update(answered(model, "before"))
    log.info("held-out evaluation: before training %s, after %s", before, after)
    examples = [
        {"reference": reference_text(c), "before": answers["before"][i], "after": answers["after"][i]}
        for i, (c, _) in enumerate(rows[:EXAMPLES])
    ]
    return {
        "score": score_name(task),
        "generated_rows": len(prompts),
        "max_new_tokens": recipe.max_new_tokens,
        "before": before,
        "after": after,
        "examples": examples,
    }
