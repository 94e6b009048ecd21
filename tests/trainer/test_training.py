"""Real (tiny) training runs through trl's SFTTrainer: LoRA on Gemma 3 and Gemma 4, QLoRA, packing, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from trainer.checkpoints import CHECKPOINT_MARKER, RUN_MARKER
from trainer.export import COMPLETION_MARKER, is_complete, merge_and_export
from trainer.recipe import Recipe, load_recipe
from trainer.train import LossMode, RunResult, build_trainer, choose_loss_mode, main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def tiny_recipe(model_dir: Path, output: Path | str, *overrides: str) -> Recipe:
    """The emoji-local recipe on a tiny model: a few steps, small batches, no TensorBoard unless asked."""
    return load_recipe(
        "emoji-local",
        [
            f"model.name_or_path={model_dir}",
            f"output.dir={output}",
            "training.max_steps=4",
            "training.save_steps=2",
            "training.logging_steps=1",
            "training.per_device_train_batch_size=4",
            "training.learning_rate=0.01",
            "training.report_to=[]",
            "data.max_rows=60",
            "data.eval_rows=8",
            *overrides,
        ],
    )


class StopAfterStep(TrainerCallback):
    """Simulates a job killed right after a checkpoint was saved (and mirrored)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"killed after step {self.step}")
        return control


class NeverTrain(TrainerCallback):
    """Fails the test if a run that should be skipped starts training."""

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a finished run was trained again")


def _lora_b_norm(adapter_dir: Path) -> float:
    from safetensors.torch import load_file

    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b, f"no LoRA B matrices in {sorted(weights)}"
    return float(sum(w.float().norm() for w in lora_b))


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


@pytest.mark.slow
def test_gemma3_lora_run_trains_saves_merges(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = main(tiny_recipe(tiny_gemma3_dir, tmp_path / "run", "training.report_to=[tensorboard]"))
    out = tmp_path / "run"
    summary = json.loads((out / "run_summary.json").read_text())
    assert isinstance(result, RunResult) and result.summary == summary
    assert summary["steps"] == 4
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["eval_loss"])
    assert summary["tokens_seen"] > 0 and summary["tokens_per_second"] > 0
    assert summary["recipe"] == "emoji-local" and summary["model"] == str(tiny_gemma3_dir)
    # where the time went, in the order it went (and priced per phase in the cost line when the stack sets a price)
    phases = summary["phases_s"]
    assert list(phases) == [
        "start", "stage_weights", "prepare_data", "load_model", "wait_for_ranks", "build_trainer",
        "find_checkpoint", "train", "evaluate", "save_adapter", "merge",
    ]  # fmt: skip
    assert all(seconds >= 0 for seconds in phases.values()) and phases["train"] > 0 and phases["merge"] > 0
    assert sum(v for k, v in phases.items() if k != "start") <= summary["wall_time_s"] + 0.1
    assert summary["cost"]["phase_seconds"] == phases and summary["ddp"] is None  # one process: no DDP wrapper
    marker = json.loads((out / RUN_MARKER).read_text())
    assert marker["summary"]["phases_s"] == phases and set(marker["upload_phases_s"]) == {"publish"}
    # LoRA B starts at zero: a non-zero B means the trainable weights changed
    assert _lora_b_norm(out / "adapter") > 0
    assert list((out / "logs").glob("events.out.tfevents.*")), "no TensorBoard events under logs/"
    assert (out / "checkpoints/checkpoint-2" / CHECKPOINT_MARKER).is_file()
    # merged (bf16 by default) is complete and stops at <end_of_turn>
    merged = Path(result.merged_dir or "")
    assert is_complete(merged)
    # the run's tokenizer is saved with the adapter and exported from memory: the same files in both
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / "adapter" / name).read_bytes() == (merged / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(merged)
    generation = json.loads((merged / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in generation["eos_token_id"]
    assert AutoModelForCausalLM.from_pretrained(merged).dtype == torch.bfloat16
    # an fp32 merge reproduces base + adapter exactly
    exact = merge_and_export(str(tiny_gemma3_dir), out / "adapter", tmp_path / "merged32", dtype="float32")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate to emoji: I ate pizza"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    base_plus_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), out / "adapter"
    )
    base_only = _logits(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), ids)
    expected = _logits(base_plus_adapter, ids)
    assert not torch.allclose(expected, base_only, atol=1e-4), "the adapter did not change the model"
    torch.testing.assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(exact), ids), expected, atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(merged), ids), expected, atol=0.1, rtol=0.05
    )


@pytest.mark.slow
def test_gemma4_lora_run_uses_completion_loss_and_merges(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    result = main(tiny_recipe(tiny_gemma4_dir, tmp_path / "run"))
    assert result.summary["steps"] == 4 and math.isfinite(result.summary["final_train_loss"])
    assert _lora_b_norm(tmp_path / "run/adapter") > 0
    assert result.merged_dir is not None and is_complete(result.merged_dir)


def test_loss_is_masked_to_the_assistant_answer(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    trainer, tokenizer = build_trainer(tiny_recipe(tiny_gemma3_dir, tmp_path / "run"), _location(tmp_path))
    labels = trainer.train_dataset[0]["labels"]
    answer = tokenizer.decode([t for t in labels if t != -100])
    assert labels[0] == -100 and labels[-1] != -100
    assert "Translate to emoji" not in answer and answer.endswith("<end_of_turn>\n")


def test_gemma4_template_falls_back_to_completion_only_loss(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    trainer, tokenizer = build_trainer(tiny_recipe(tiny_gemma4_dir, tmp_path / "run"), _location(tmp_path))
    assert choose_loss_mode(tokenizer, assistant_only=True) is LossMode.COMPLETION
    labels = trainer.train_dataset[0]["labels"]
    answer = tokenizer.decode([t for t in labels if t != -100])
    assert labels[0] == -100 and "Translate to emoji" not in answer and answer.strip()


@pytest.mark.slow
def test_padding_free_batches_train_like_padded_ones(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """`training.padding_free` without packing (the demo recipe's setting): no pad positions, and the same
    conversations per update, losses and adapter weights as padded batches."""
    from transformers import set_seed

    runs: dict[bool, dict[str, object]] = {}
    for padding_free in (False, True):
        out = tmp_path / f"padding-free-{padding_free}"
        recipe = tiny_recipe(
            tiny_gemma3_dir,
            out,
            f"training.padding_free={str(padding_free).lower()}",
            "training.max_steps=2",
            "lora.dropout=0",
            "data.eval_rows=0",
            "output.merge=false",
        )
        trainer, _ = build_trainer(recipe, _location(out))
        batch = next(iter(trainer.get_train_dataloader()))
        set_seed(0)
        trainer.train()
        runs[padding_free] = {
            "batch": batch,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad},
        }
    padded, free = runs[False]["batch"], runs[True]["batch"]
    assert isinstance(padded, dict) and isinstance(free, dict)
    assert "attention_mask" not in free and free["input_ids"].shape[0] == 1, "one row, no padding"
    assert int(padded["attention_mask"].sum()) < padded["input_ids"].numel(), "the padded batch has pad positions"
    real = padded["input_ids"][padded["attention_mask"].bool()]
    assert torch.equal(free["input_ids"][0], real), "the same conversations, in the same order, without pads"
    assert runs[True]["losses"] == pytest.approx(runs[False]["losses"], rel=1e-5)
    weights_free, weights_padded = runs[True]["weights"], runs[False]["weights"]
    assert isinstance(weights_free, dict) and isinstance(weights_padded, dict)
    for name, weight in weights_padded.items():
        torch.testing.assert_close(weights_free[name], weight, rtol=1e-5, atol=1e-6)


def test_packed_conversations_do_not_attend_across_boundaries(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Packing puts several conversations in one row; each must still see only itself.

    How trl 1.16 does it (trl/data_utils.py `pack_dataset`, strategy "bfd"; trl/trainer/sft_trainer.py
    `DataCollatorForLanguageModeling.torch_call` with padding_free): whole conversations are packed
    best-fit-decreasing, each packed row keeps its `seq_lengths`, and the collator sends NO attention
    mask but `position_ids` that restart at 0 for every conversation (plus `cu_seq_lens_*` for varlen
    kernels), and masks the label at each restart. transformers 5 (masking_utils.py
    `find_packed_sequence_indices`) turns restarting positions into a block-diagonal causal mask for
    sdpa/eager. This test checks the outcome, not the mechanism: the logits of every conversation in a
    packed row equal its logits when run alone.
    """
    recipe = tiny_recipe(
        tiny_gemma3_dir,
        tmp_path / "run",
        "training.packing=true",
        "training.packing_reason=isolation test",
        "training.per_device_train_batch_size=1",
        "training.max_length=128",
    )
    trainer, _ = build_trainer(recipe, _location(tmp_path))
    packed = trainer.train_dataset
    assert len(packed) < 52  # 60 rows - 8 held out, packed into fewer sequences
    row = max(packed, key=lambda r: len(r["seq_lengths"]))
    lengths = row["seq_lengths"]
    assert len(lengths) >= 3, lengths
    batch = trainer.data_collator([row])
    assert "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    assert all(batch["labels"][0, s] == -100 for s in starts), "a label predicts across a boundary"

    model = trainer.model.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        packed_logits = model(**inputs).logits[0]
        unmasked_logits = model(input_ids=batch["input_ids"]).logits[0]  # one long sequence, no restarts
    for start, n in zip(starts, lengths, strict=True):
        alone = _logits(model, batch["input_ids"][:, start : start + n])[0]
        torch.testing.assert_close(packed_logits[start : start + n], alone, atol=1e-5, rtol=1e-4)
    last = starts[-1]
    assert not torch.allclose(unmasked_logits[last:], packed_logits[last:], atol=1e-3), (
        "the check has no teeth: without restarting positions the last conversation should see the others"
    )
    trainer.args.max_steps = 1
    assert math.isfinite(trainer.train().training_loss)  # and the packed batch trains


@pytest.mark.slow
def test_qlora_nf4_on_cpu(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    import bitsandbytes as bnb

    recipe = tiny_recipe(
        tiny_gemma3_dir,
        tmp_path / "run",
        "quantization.quant_type=nf4",
        "quantization.compute_dtype=bfloat16",
        "training.max_steps=2",
        "output.merge=false",
    )
    trainer, _ = build_trainer(recipe, _location(tmp_path))
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and quantized[0].weight.quant_state.quant_type == "nf4"
    # trl 1.16 casts a quantized model's trainable parameters to bf16; the adapters train in fp32 all the same
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}, {p.dtype for p in trainable.values()}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    output = trainer.train()  # train before any generate call: bitsandbytes CPU kernels prefer that order
    assert math.isfinite(output.training_loss)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {trainer.optimizer.state[p]["exp_avg"].dtype for p in trainable.values()} == {torch.float32}
    assert any(not torch.equal(before[n], p) for n, p in trainable.items()), "the adapters did not train"


@pytest.mark.slow
def test_killed_run_resumes_from_its_checkpoint(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main(tiny_recipe(tiny_gemma3_dir, out, "output.merge=false"), callbacks=[StopAfterStep(2)])
    assert (out / "checkpoints/checkpoint-2" / CHECKPOINT_MARKER).is_file()
    assert not (out / "adapter").exists()
    # a later, unmarked checkpoint (killed while saving) must be ignored
    (out / "checkpoints/checkpoint-3").mkdir()
    result = main(tiny_recipe(tiny_gemma3_dir, out, "output.merge=false"))
    assert result.summary["resumed_from_step"] == 2
    assert result.summary["steps"] == 4


@pytest.mark.slow
def test_checkpoints_mirror_to_a_url_and_resume_on_a_new_machine(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = tmp_path / "bucket/runs/emoji"
    url = f"file://{remote}"
    monkeypatch.setenv("GEMMA_FT_STAGING", str(tmp_path / "machine-1"))
    with pytest.raises(KeyboardInterrupt):
        main(tiny_recipe(tiny_gemma3_dir, url), callbacks=[StopAfterStep(2)])
    assert (remote / "checkpoints/checkpoint-2" / CHECKPOINT_MARKER).is_file()
    assert (remote / "checkpoints/checkpoint-2/adapter_model.safetensors").is_file()
    monkeypatch.setenv("GEMMA_FT_STAGING", str(tmp_path / "machine-2"))  # the first machine is gone
    result = main(tiny_recipe(tiny_gemma3_dir, url))
    assert result.summary["resumed_from_step"] == 2 and result.summary["steps"] == 4
    assert result.merged_dir == f"{url}/merged"
    assert (remote / "merged" / COMPLETION_MARKER).is_file() and is_complete(result.merged_dir)
    assert (remote / "adapter/adapter_model.safetensors").is_file()
    assert json.loads((remote / "run_summary.json").read_text())["steps"] == 4
    # the run marker is the last file written to the bucket, and a rerun finds it and does nothing
    marker = remote / RUN_MARKER
    others = [p.stat().st_mtime_ns for p in remote.rglob("*") if p.is_file() and p != marker]
    assert marker.is_file() and marker.stat().st_mtime_ns >= max(others)
    monkeypatch.setenv("GEMMA_FT_STAGING", str(tmp_path / "machine-3"))
    again = main(tiny_recipe(tiny_gemma3_dir, url), callbacks=[NeverTrain()])
    assert again == result
    assert not (tmp_path / "machine-3").exists(), "the rerun staged something"


def _location(tmp_path: Path):  # type: ignore[no-untyped-def]
    from trainer.checkpoints import OutputLocation

    return OutputLocation.from_dir(str(tmp_path / "run"))
