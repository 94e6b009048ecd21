"""A W1 checkpoint under FSDP2 holds the adapter and what resuming needs, and gathers none of the base weights.

Why it matters: transformers' checkpoint under FSDP with FULL_STATE_DICT gathers the WHOLE model to rank 0's
CPU at every `save_steps` to keep a small adapter (docs/distributed.md#fsdp-checkpoints-hold-the-adapter-only); now a
checkpoint is the adapter-only FSDP model file, the optimizer, scheduler, RNG and trainer state
(trainer/fsdp.py `checkpoints_without_the_base`).

The run is `python -m trainer` on the W1 recipe and a tiny Gemma 4, 2 ranks under accelerate's own launcher
with the config `trainer.launch` renders (FSDP2, FULL_STATE_DICT, RAM-efficient loading), gloo on loopback.
A sitecustomize module gives accelerate's state a GPU node's view (as tests/trainer/test_ram_efficient_loading.py
does); accelerate's `fsdp2_prepare_model` really shards (torch `fully_shard` on CPU). Spies record every gather
(`get_model_state_dict` with full_state_dict, `DTensor.full_tensor`) and each `fully_shard`'s policy. An
uninterrupted 2-step launch (module fixture `straight_run`) saves checkpoint-1 and checkpoint-2; a second launch
on a folder holding only its checkpoint-1 (what a run killed after that checkpoint leaves) resumes to step 2 and
must equal it. The straight launch also answers held-out rows, which the run-evaluation test below checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from demo.local_server import free_port
from tests.trainer.inject import AFTER_IMPORT

REPO = Path(__file__).resolve().parents[2]
RECIPE = "text-to-sql-gemma4-31b"
NPROC = 2

# Imported by every process of the run (first on PYTHONPATH); acts in the torchrun workers only.
FSDP_ON_CPU = (
    AFTER_IMPORT
    + """
import json
import os

if "LOCAL_RANK" in os.environ:

    def _fsdp_view(state_module):
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        init = state_module.AcceleratorState.__init__

        def init_as_on_gpus(self, *args, **kwargs):
            init(self, *args, **kwargs)
            # every time: accelerate's state is initialised again (AcceleratedOptimizer) from the process' view
            if self.distributed_type == DistributedType.MULTI_CPU:
                self.distributed_type = DistributedType.FSDP
                if getattr(self, "fsdp_plugin", None) is None:
                    self.fsdp_plugin = FullyShardedDataParallelPlugin()  # from accelerate launch's FSDP_* variables
                    if self._mixed_precision != "no":
                        self.fsdp_plugin.set_mixed_precision(self._mixed_precision)

        state_module.AcceleratorState.__init__ = init_as_on_gpus

    def _spy_gathers(module):
        get = module.get_model_state_dict

        def spied(model, *args, options=None, **kwargs):
            state_dict = get(model, *args, options=options, **kwargs)
            if options is not None and options.full_state_dict:
                record = {"rank": int(os.environ["RANK"]), "keys": sorted(state_dict)}
                with open(os.environ["GATHER_LOG"], "a") as out:
                    out.write(json.dumps(record) + "\\n")
            return state_dict

        module.get_model_state_dict = spied

    def _spy_full_tensor(module):
        full_tensor = module.DTensor.full_tensor

        def spied(self, *args, **kwargs):
            with open(os.environ["GATHER_LOG"], "a") as out:
                out.write(json.dumps({"rank": int(os.environ["RANK"]), "full_tensor": self.numel()}) + "\\n")
            return full_tensor(self, *args, **kwargs)

        module.DTensor.full_tensor = spied

    def _spy_fully_shard(module):
        fully_shard = module.fully_shard

        def spied(target, *args, mp_policy=None, **kwargs):
            with open(os.environ["GATHER_LOG"], "a") as out:
                out.write(json.dumps({"rank": int(os.environ["RANK"]), "reduce_dtype": str(mp_policy.reduce_dtype)}) + "\\n")
            return fully_shard(target, *args, mp_policy=mp_policy, **kwargs)

        module.fully_shard = spied

    _after_import("accelerate.state", _fsdp_view)
    _after_import("torch.distributed.fsdp", _spy_fully_shard)
    _after_import("torch.distributed.checkpoint.state_dict", _spy_gathers)
    _after_import("torch.distributed.tensor", _spy_full_tensor)
"""
)


# Every launch here: 4 held-out rows, a learning rate at which 2 steps change the answers; no answers generated
# (only the loss is evaluated) unless ANSWERING is added, which changes nothing the training does.
def overrides(model_dir: Path, out_dir: Path, max_steps: int) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        "model.dtype=float32",
        "distributed.strategy=fsdp",  # FSDP checkpoints are the point; the memory model would pick DDP here
        "data.source=local",
        "data.path=trainer/samples/text_to_sql.jsonl",
        "data.max_rows=40",
        "data.eval_rows=4",
        "training.learning_rate=0.05",
        "training.warmup_ratio=0.0",
        "evaluation.generate_rows=0",
        "output.merge=false",
        f"training.max_steps={max_steps}",
        "training.save_steps=1",
        "training.save_total_limit=null",
        "training.eval_steps=null",
        "training.logging_steps=1",
        "training.gradient_accumulation_steps=1",
        "training.optim=adamw_torch",
        "training.report_to=[]",
        f"distributed.world_size={NPROC}",
        f"output.dir={out_dir}",
    ]


def launch(
    tmp_path: Path, model_dir: Path, out_dir: Path, max_steps: int, gather_log: Path, extra: Sequence[str] = ()
) -> str:
    """Both ranks by the real launcher on CPU processes made FSDP2 (`FSDP_ON_CPU`); `extra` overrides win."""
    from trainer import launch as launcher

    argv = ["--recipe", RECIPE, "--nproc-per-node", str(NPROC), "--main-process-port", str(free_port())]
    argv += ["--config-out", str(tmp_path / f"accelerate-{max_steps}.yaml")]
    for item in [*overrides(model_dir, out_dir, max_steps), *extra]:
        argv += ["--set", item]
    plan = launcher.plan(launcher.parse_args(argv), env={})
    fsdp = plan.config["fsdp_config"]
    assert plan.config["distributed_type"] == "FSDP" and fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    inject = tmp_path / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(FSDP_ON_CPU)
    env = {
        **os.environ,
        "PYTHONPATH": f"{inject}{os.pathsep}{REPO}",
        "ACCELERATE_USE_CPU": "true",  # the CPU processes, over gloo; the sitecustomize makes it FSDP
        "GATHER_LOG": str(gather_log),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    done = subprocess.run(plan.command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    (tmp_path / f"launch-{max_steps}.log").write_text(output)
    assert done.returncode == 0, output[-8000:]
    return output


def gathers(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# the uninterrupted run also answers 3 held-out rows (batches of 2 over 2 ranks)
ANSWERING = ("evaluation.generate_rows=3", "evaluation.max_new_tokens=5", "evaluation.batch_size=2")


@dataclass(frozen=True)
class StraightRun:
    out_dir: Path
    output: str
    gather_log: Path


@pytest.fixture(scope="module")
def straight_run(tiny_gemma4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> StraightRun:
    """The uninterrupted 2-step launch: its checkpoint-1 is what the resume test resumes, its checkpoint-2 what
    the resumed run must equal; and the run-evaluation test's run."""
    tmp_path = tmp_path_factory.mktemp("straight")
    out_dir, gather_log = tmp_path / "run", tmp_path / "gathers.jsonl"
    output = launch(tmp_path, tiny_gemma4_dir, out_dir, 2, gather_log, extra=ANSWERING)
    return StraightRun(out_dir, output, gather_log)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_holds_the_adapter_and_resumes(
    tiny_gemma4_dir: Path, tmp_path: Path, straight_run: StraightRun
) -> None:
    import torch
    from safetensors.torch import load_file

    straight_dir = straight_run.out_dir
    checkpoint = straight_dir / "checkpoints" / "checkpoint-1"
    written = sorted(p.name for p in checkpoint.iterdir())
    print(json.dumps({"checkpoint-1": written, "gathers": gathers(straight_run.gather_log)}, indent=1)[:4000])

    # what a checkpoint writes: the adapter in transformers' FSDP model file, the optimizer (accelerate's
    # FSDP optimizer file), scheduler, every rank's RNG state, the trainer state, our marker; no model
    assert set(written) == {
        "pytorch_model_fsdp.bin",
        "optimizer.bin",
        "scheduler.pt",
        "trainer_state.json",
        "_CHECKPOINT_COMPLETE.json",
        *(f"rng_state_{rank}.pth" for rank in range(NPROC)),
    }, written
    adapter = torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=True)
    assert adapter and all(".lora_" in key for key in adapter), sorted(adapter)[:5]
    # what the run gathered: the adapter, once for each checkpoint (1 and 2) and once for the final adapter, on each
    # rank; no full state dict of the model (the old checkpoint: every frozen weight, then the tied LM head)
    adapter_numel = sum(t.numel() for t in adapter.values())
    final = load_file(straight_dir / "adapter" / "adapter_model.safetensors")
    assert sum(t.numel() for t in final.values()) == adapter_numel
    recorded = gathers(straight_run.gather_log)
    for rank in range(NPROC):
        gathered = sum(r["full_tensor"] for r in recorded if r["rank"] == rank and "full_tensor" in r)
        assert gathered == 3 * adapter_numel, (
            f"rank {rank} gathered {gathered} elements, the adapter has {adapter_numel}"
        )
    # the trainer's FSDP setup: accelerate sharded every block with fp32 gradient reduction (test_fsdp_config.py)
    policies = [r["reduce_dtype"] for r in recorded if "reduce_dtype" in r]
    assert len(policies) > NPROC and set(policies) == {"torch.float32"}, policies
    full_state_dicts = [r for r in recorded if "keys" in r]
    for record in full_state_dicts:
        assert all(".lora_" in key for key in record["keys"]), f"a full state dict gathered {record['keys'][:5]}"

    # and it resumes: a launch on a folder that holds only checkpoint-1 (a run killed after it) loads adapter,
    # optimizer and RNG states and trains step 2
    out_dir = tmp_path / "run"
    resumable = out_dir / "checkpoints" / "checkpoint-1"
    shutil.copytree(checkpoint, resumable)
    output = launch(tmp_path, tiny_gemma4_dir, out_dir, max_steps=2, gather_log=tmp_path / "gathers-resumed.jsonl")
    summary = json.loads((out_dir / "run_summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2, summary
    assert output.count(f"resuming from {resumable}") == NPROC, output[-4000:]
    resumed = torch.load(out_dir / "checkpoints" / "checkpoint-2" / "pytorch_model_fsdp.bin", weights_only=True)
    assert resumed.keys() == adapter.keys() and any(not torch.equal(resumed[k], adapter[k]) for k in adapter)

    # resumed from the checkpoint's adapter and optimizer, not from a fresh adapter: the same weights as the
    # uninterrupted run (a load that matched no key would pass strict=False silently)
    straight = torch.load(straight_dir / "checkpoints" / "checkpoint-2" / "pytorch_model_fsdp.bin", weights_only=True)
    for key, tensor in straight.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_fsdp_ranks_share_the_answers_and_rank_0_writes_them_all(
    tiny_gemma4_dir: Path, tmp_path: Path, straight_run: StraightRun
) -> None:
    """trainer/run_eval.py under FSDP2 (from tests/trainer/test_run_eval.py, which scores the one-process runs): the
    uninterrupted launch answers 3 rows, rank 0 the first 2 and rank 1 the third (and a repeat, dropped), every forward
    in step; the summary holds all 3, and the answers are the evaluator's on the base model's folder (adapter off) and
    on the adapter the run saved (adapter on)."""
    from trainer.evaluate import evaluate
    from trainer.recipe import load_recipe

    out, output = straight_run.out_dir, straight_run.output
    # each side (base, tuned): rank 0 answers rows 1-2, rank 1 row 3 (its second share is a repeat, dropped)
    assert output.count("rank 0 of 2 answers held-out rows 1-2 of 3") == 2, output[-8000:]
    assert output.count("rank 1 of 2 answers held-out rows 3-3 of 3") == 2, output[-8000:]
    run_eval = json.loads((out / "run_summary.json").read_text())["eval"]
    assert run_eval["score"] == "execution_match" and run_eval["generated_rows"] == 3
    assert set(run_eval["after"]) == {"loss", "exact_match", "rouge_l_f1", "execution_match"}
    assert run_eval["after"]["loss"] < run_eval["before"]["loss"]

    recipe = load_recipe(RECIPE, [*overrides(tiny_gemma4_dir, out, 2), *ANSWERING])
    base = evaluate(tiny_gemma4_dir, recipe, max_samples=3, out=tmp_path / "base.json")
    tuned = evaluate(out / "adapter", recipe, max_samples=3, out=tmp_path / "tuned.json")
    assert [e["before"] for e in run_eval["examples"]] == [p["prediction"] for p in base["predictions"]]
    assert [e["after"] for e in run_eval["examples"]] == [p["prediction"] for p in tuned["predictions"]]
    assert [e["reference"] for e in run_eval["examples"]] == [p["reference"] for p in base["predictions"]]
