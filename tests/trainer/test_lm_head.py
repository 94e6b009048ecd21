"""The labels-only LM head (trainer/lm_head.py) computes the same loss, gradients and metrics as trl's full head.

trl 1.16's fused head projects every position on a CPU and only the labelled ones on Triton devices;
ours projects only the labelled ones everywhere (one `nonzero`). Each test runs the same tiny model twice, with
trl's own choice and with ours, and compares what training uses: the loss (also against the model's
own cross-entropy over full logits), every LoRA gradient, and the per-token log-probabilities, entropy
and top-1 hits trl logs as `entropy` and `mean_token_accuracy`. A spy on trl's head kernel counts the
positions actually projected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.lm_head import score_every_position, score_labelled_positions_only

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TRL_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks its fused head for (sft_trainer.py)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: a second OpenMP thread only waits, and on a busy machine its spinning made each step ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def projected_rows(monkeypatch: pytest.MonkeyPatch, head_kernels: list[str]) -> Iterator[list[int]]:
    """Rows of hidden states each call of a fused-head kernel projects onto the vocabulary (`head_kernels`: which)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from trainer.cpu_logprob import LabelledRowsLogProb

    rows: list[int] = []
    for name, kernel in (("trl", ChunkedLogProbFunction), ("cpu", LabelledRowsLogProb)):

        def spy(ctx: Any, hidden: torch.Tensor, *args: Any, _name: str = name, _forward: Any = kernel.forward) -> Any:
            rows.append(int(hidden.shape[0]))
            head_kernels.append(_name)
            return _forward(ctx, hidden, *args)

        monkeypatch.setattr(kernel, "forward", staticmethod(spy))
    yield rows


@pytest.fixture
def head_kernels() -> list[str]:
    """Which kernel each projection of `projected_rows` ran: trl's ("trl") or trainer/cpu_logprob.py's ("cpu")."""
    return []


def _peft_model(tokenizer: Any, family: str, labels_only: bool) -> Any:
    """A tiny Gemma with LoRA and trl's fused head, as SFTTrainer builds it; identical weights on every call."""
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from tests.tiny_models import tiny_gemma3, tiny_gemma4
    from trainer.modeling import lora_config
    from trainer.recipe import LoraSpec

    model = tiny_gemma3(tokenizer) if family == "gemma3" else tiny_gemma4(tokenizer)
    if family == "gemma3":
        model.config.final_logit_softcapping = 30.0  # Gemma 2's cap: the head must apply it in both branches
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config(LoraSpec(r=4, alpha=8, dropout=0.0), model))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would make every A gradient zero
            torch.nn.init.normal_(param, std=0.02)
    add_fused_lm_head(peft_model.get_base_model(), outputs=TRL_OUTPUTS)
    if labels_only:
        assert score_labelled_positions_only(peft_model)
    return peft_model


@dataclass(frozen=True)
class Batch:
    inputs: dict[str, torch.Tensor]
    labelled: int  # next-token targets that are not -100

    @property
    def positions(self) -> int:
        ids = self.inputs["input_ids"]
        return int(ids.shape[0] * (ids.shape[1] - 1))


def _batch(kind: str) -> Batch:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(8, 500, (2, 16), generator=generator)
    labels = ids.clone()
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if kind == "every position":
        pass
    elif kind == "prompt masked":
        labels[:, :11] = -100
    elif kind == "one label":
        labels[:] = -100
        labels[1, 9] = ids[1, 9]
    elif kind == "no label":
        labels[:] = -100
    elif kind == "padded":  # right padding of the second row, prompt masked as the collator does
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["attention_mask"][1, 10:] = 0
        labels[:, :6] = -100
        labels[1, 10:] = -100
    elif kind == "packed padding-free":  # trl's padding-free row: sequences of 7, 5 and 4, positions restart
        ids = ids[:1]
        lengths = [7, 5, 4]
        inputs = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
        labels = ids.clone()
        starts = [0, 7, 12]
        for start, prompt in zip(starts, (4, 2, 3), strict=True):
            labels[0, start : start + prompt] = -100  # each sequence's prompt (its first token included)
    else:
        raise AssertionError(kind)
    inputs["labels"] = labels
    return Batch(inputs, int((labels[:, 1:] != -100).sum()))


KINDS = ["every position", "prompt masked", "one label", "no label", "padded", "packed padding-free"]


def _assert_same_gradients(ours: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 summation order: the two heads project different numbers of rows through BLAS."""
    assert ours.keys() == full.keys() and any("lora_A" in n for n in ours)
    for name, grad in full.items():
        scale = float(grad.abs().max())
        difference = float((ours[name] - grad).abs().max())
        assert difference <= 1e-5 * scale + 1e-9, (
            f"{name}: max |difference| {difference:.3g}, max |gradient| {scale:.3g}"
        )


def _run(model: Any, batch: Batch, **extra: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch.inputs, fused_lm_head=True, **extra)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


@pytest.fixture(scope="module")
def models(tiny_tokenizer_session: Any) -> dict[str, Any]:
    """One tiny model per family, shared by the cases below: each case switches its head both ways."""
    return {family: _peft_model(tiny_tokenizer_session, family, False) for family in ("gemma3", "gemma4")}


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_gradients_and_metrics_equal_the_full_head(
    models: dict[str, Any], family: str, kind: str, projected_rows: list[int], head_kernels: list[str]
) -> None:
    batch, model = _batch(kind), models[family]
    score_every_position(model)
    full_out, full_grads = _run(model, batch)
    assert score_labelled_positions_only(model)
    ours_out, ours_grads = _run(model, batch)

    # trl scores every position on the CPU; ours only the labelled ones, with the CPU kernel
    assert projected_rows == [batch.positions, batch.labelled]
    assert head_kernels == ["trl", "cpu"]

    torch.testing.assert_close(ours_out.loss, full_out.loss, rtol=1e-6, atol=1e-7)
    for field in ("log_probs", "entropy", "is_top1", "label_mask"):
        torch.testing.assert_close(getattr(ours_out, field), getattr(full_out, field), rtol=1e-6, atol=1e-6)
    _assert_same_gradients(ours_grads, full_grads)
    if batch.labelled:
        assert any(g.abs().max() > 0 for g in ours_grads.values()), "no gradient reached the adapters"
        # and both are the model's own loss: cross-entropy over the full logits
        with torch.no_grad():
            reference = model(**batch.inputs, use_cache=False).loss  # the trainer's forward has no cache either
        torch.testing.assert_close(ours_out.loss.detach(), reference, rtol=1e-5, atol=1e-6)
    else:
        assert float(ours_out.loss) == 0.0 and all(float(g.abs().max()) == 0 for g in ours_grads.values())


def test_gradient_accumulation_normalisation_is_kept(tiny_tokenizer: Any, projected_rows: list[int]) -> None:
    """With `num_items_in_batch` (tokens of the whole accumulated step) both heads divide by it, not by their own count."""
    batch = _batch("prompt masked")
    items = torch.tensor(3 * batch.labelled)
    full_out, full_grads = _run(_peft_model(tiny_tokenizer, "gemma3", False), batch, num_items_in_batch=items)
    ours_out, ours_grads = _run(_peft_model(tiny_tokenizer, "gemma3", True), batch, num_items_in_batch=items)
    torch.testing.assert_close(ours_out.loss, full_out.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_out.loss, -ours_out.log_probs.sum() / items)
    _assert_same_gradients(ours_grads, full_grads)


def test_a_model_without_it_keeps_trls_choice(tiny_tokenizer: Any, projected_rows: list[int]) -> None:
    """Per model, not per process: the benchmark trains the seed's unpatched model next to ours."""
    batch = _batch("prompt masked")
    ours, theirs = _peft_model(tiny_tokenizer, "gemma3", True), _peft_model(tiny_tokenizer, "gemma3", False)
    with torch.no_grad():
        ours(**batch.inputs, fused_lm_head=True)
        theirs(**batch.inputs, fused_lm_head=True)
        score_every_position(ours)
        ours(**batch.inputs, fused_lm_head=True)
    assert projected_rows == [batch.labelled, batch.positions, batch.positions]


def test_generation_is_unchanged(tiny_tokenizer: Any) -> None:
    """`generate` validates its kwargs against the forward's signature and never asks for the fused head."""
    prompt = torch.tensor([[2, 40, 41, 42, 43]])
    outputs = []
    for labels_only in (False, True):
        model = _peft_model(tiny_tokenizer, "gemma3", labels_only).eval()
        with torch.no_grad():
            outputs.append(model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape[1] == prompt.shape[1] + 6


def _train_two_steps(recipe_for: Callable[[str], Any], tmp_path: Path, labels_only: bool) -> dict[str, Any]:
    from transformers import set_seed

    from trainer.checkpoints import OutputLocation
    from trainer.train import build_trainer

    name = "ours" if labels_only else "trl"
    recipe = recipe_for(str(tmp_path / name))
    trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    if not labels_only:
        score_every_position(trainer.model)
    set_seed(0)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"logs": logs, "weights": weights}


def test_the_trainer_uses_it_and_trains_the_same(
    tiny_gemma3_dir: Path, tmp_path: Path, projected_rows: list[int], head_kernels: list[str]
) -> None:
    """Through build_trainer (the path of `python -m trainer` and of Ray's text recipes): same updates, same metrics."""
    from trainer.recipe import load_recipe

    def recipe_for(out: str) -> Any:
        return load_recipe(
            "emoji-local",
            [
                f"model.name_or_path={tiny_gemma3_dir}",
                f"output.dir={out}",
                "training.max_steps=2",
                "training.save_steps=2",
                "training.logging_steps=1",
                "training.per_device_train_batch_size=4",
                "training.learning_rate=0.01",
                "training.report_to=[]",
                "lora.dropout=0",
                "data.max_rows=24",
                "data.eval_rows=0",
                "output.merge=false",
            ],
        )

    trl_run = _train_two_steps(recipe_for, tmp_path, labels_only=False)
    trl_rows = list(projected_rows)
    projected_rows.clear()
    ours = _train_two_steps(recipe_for, tmp_path, labels_only=True)

    assert len(projected_rows) == len(trl_rows) == 2
    assert head_kernels == ["trl", "trl", "cpu", "cpu"]
    assert all(o < t for o, t in zip(projected_rows, trl_rows, strict=True)), (projected_rows, trl_rows)
    for key in ("loss", "entropy", "mean_token_accuracy", "grad_norm"):
        got, want = [e[key] for e in ours["logs"]], [e[key] for e in trl_run["logs"]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    for name, weight in trl_run["weights"].items():
        torch.testing.assert_close(ours["weights"][name], weight, rtol=1e-5, atol=1e-6)
    from trl.kernels import chunked_logprob  # and trl's Triton kernel only where it builds (test_triton_build.py)

    assert getattr(chunked_logprob._use_triton, "_gemma_ft_builds_only", False)


def test_the_vision_trainer_uses_it(tiny_gemma3_vision_dir: Path, tmp_path: Path, projected_rows: list[int]) -> None:
    """trainer/ray_entry.py builds image+text trainers through the same constructor."""
    from tests.trainer.ray_cluster import tiny_recipe_overrides
    from trainer.checkpoints import OutputLocation
    from trainer.ray_entry import build_vision_trainer
    from trainer.recipe import load_recipe

    recipe = load_recipe(
        "product-descriptions-gemma3-4b",
        [*tiny_recipe_overrides(tiny_gemma3_vision_dir), f"output.dir={tmp_path}", "quantization=null"],
    )
    trainer, _ = build_vision_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    with torch.no_grad():
        trainer.model(**batch, fused_lm_head=True)
    assert projected_rows == [int((batch["labels"][:, 1:] != -100).sum())]
    assert projected_rows[0] < batch["input_ids"].shape[1] - 1
