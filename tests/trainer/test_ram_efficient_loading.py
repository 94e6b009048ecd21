"""FSDP2's RAM-efficient loading, under 2 ranks: only rank 0 reads the weights; rank 1 still ends up with the model.

Why it matters: on an A4 node 8 ranks load Gemma 4 31B before FSDP shards it; ranks other than local rank 0
must never read the weights (trainer/modeling.py; docs/distributed.md#only-rank-0-reads-the-base-weights).

accelerate's own launcher starts 2 processes over gloo on loopback with the config `trainer.launch` renders
for the W1 recipe; each runs `trainer.train.training_inputs` and reports its peak RSS growth. accelerate
shards with FSDP2 only on GPUs, so the test gives its state a GPU node's view and calls
`Accelerator.prepare(model, optimizer)` on the recipe's LoRA model and an AdamW, as the Trainer does. Both
ranks' logits must equal an unsharded forward, every rank's optimizer hold its own adapter shards, and one
step change each of them. The checkpoint is float32 and the recipe bfloat16, so a rank that reads the
weights holds a converted copy its RSS shows.

This file is also the worker:
    accelerate launch --config_file CONFIG tests/trainer/test_ram_efficient_loading.py OUT_DIR MODEL_DIR
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from demo.local_server import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE = "text-to-sql-gemma4-31b"
# ~41 M parameters: about 157 MB in float32 on disk, 79 MB in bfloat16 once loaded. Large enough that a
# rank that loads no weights stays clearly below a quarter of the checkpoint: the run's other allocations
# (tokenizer, data) grew rank 1's peak RSS by up to ~24 MB (23.6 MB against a 23.3 MB bound with a 93 MB
# checkpoint failed once in a fresh-clone CI run)
TEXT_DIMS = {
    "vocab_size": 65536,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_attention_heads": 4,
    "head_dim": 128,
    "global_head_dim": 128,
}


def overrides(model_dir: str, out_dir: str) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        "data.source=local",
        "data.path=trainer/samples/text_to_sql.jsonl",
        "data.max_rows=16",
        "data.eval_rows=0",
        # The ranks build the run (SFTConfig, model) but train no step. Bounded by max_steps, its length is chosen,
        # not computed from 16 rows (3 updates), so the recipe's save_steps/eval_steps of 20 are not held to it.
        "training.max_steps=1",
        "training.report_to=[]",
        "distributed.world_size=2",
        # FSDP is what this test is about; the memory model would pick DDP for the tiny model
        "distributed.strategy=fsdp",
        f"output.dir={out_dir}",
    ]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(out_dir: str, model_dir: str) -> None:
    """One rank: training_inputs, then accelerate's FSDP2 preparation, then a forward on both ranks."""
    import datasets  # noqa: F401  (imported before the baseline: only the model may grow the RSS)
    import peft
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401
    import trl  # noqa: F401
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers.integrations import is_fsdp_enabled

    from trainer.checkpoints import OutputLocation
    from trainer.recipe import load_recipe
    from trainer.train import training_inputs

    torch.set_num_threads(1)
    baseline = peak_rss_mb()
    recipe = load_recipe(RECIPE, overrides(model_dir, str(Path(out_dir) / "run")))
    inputs = training_inputs(recipe, OutputLocation.from_dir(recipe.output.dir))
    loaded = peak_rss_mb()
    rank = dist.get_rank()
    model = inputs.model.eval()
    devices = sorted({p.device.type for p in model.parameters()})

    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        if rank == 0:
            reference = model(input_ids=ids).logits.float()
        else:
            reference = torch.empty(1, ids.shape[1], model.config.get_text_config().vocab_size)
    dist.broadcast(reference, src=0)

    # accelerate's own FSDP2 preparation, with the optimizer the Trainer creates before it (transformers 5.23
    # creates the optimizer first under FSDP2): accelerate maps the optimizer's parameters to the shards.
    # On a machine without GPUs the PartialState TrainingArguments built (the launcher's FSDP config has no
    # use_cpu) calls every process the only one and accelerate never picks FSDP (accelerate 1.15 state.py):
    # the test gives it the 2-process view and the FSDP type it has on GPUs, nothing else.
    state = PartialState._shared_state
    state.update(
        process_index=rank, local_process_index=rank, num_processes=2, distributed_type=DistributedType.MULTI_CPU
    )
    accelerator = Accelerator()
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin = FullyShardedDataParallelPlugin()  # from accelerate launch's FSDP_* vars
    peft_model = peft.get_peft_model(model, inputs.peft_config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    sharded, optimizer = accelerator.prepare(peft_model, optimizer)
    sharded.eval()
    with torch.no_grad():
        logits = sharded(input_ids=ids).logits.float()
    trainable = {n: p for n, p in sharded.named_parameters() if p.requires_grad}
    held = {
        n for n, p in sharded.named_parameters() for group in optimizer.param_groups for q in group["params"] if q is p
    }
    before = {n: p.to_local().detach().clone() for n, p in trainable.items()}
    sharded.train()
    accelerator.backward(sharded(input_ids=ids, labels=ids).loss)
    optimizer.step()
    changed = sorted(n for n, p in trainable.items() if not torch.equal(before[n], p.to_local().detach()))
    report = {
        "rank": rank,
        "world": dist.get_world_size(),
        "is_fsdp_enabled": is_fsdp_enabled(),
        "ram_efficient_plugin": plugin.cpu_ram_efficient_loading,
        "class": type(model).__name__,
        "param_devices": devices,
        "baseline_mb": baseline,
        "loaded_mb": loaded,
        "max_logit_diff": float((logits - reference).abs().max()),
        "trainable": sorted(trainable),
        "optimizer_holds": sorted(held),
        "changed_by_a_step": changed,
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ranks_other_than_0_load_no_weights_and_fsdp2_fills_them(tmp_path: Path) -> None:
    from tests.tiny_models import save_tiny_model
    from trainer import launch

    model_dir = save_tiny_model(tmp_path / "model", "gemma4", **TEXT_DIMS)
    checkpoint_mb = (model_dir / "model.safetensors").stat().st_size / 2**20
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = ["--recipe", RECIPE, "--nproc-per-node", "2", "--main-process-port", str(free_port())]
    argv += ["--config-out", str(tmp_path / "accelerate.yaml")]
    for item in overrides(str(model_dir), str(out_dir / "run")):
        argv += ["--set", item]
    plan = launch.plan(launch.parse_args(argv), env={})
    assert plan.config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True and not plan.config["use_cpu"]
    head = plan.command[: plan.command.index("--config_file") + 2]  # the same accelerate and config
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",  # loopback only
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    done = subprocess.run(
        [*head, str(Path(__file__).resolve()), str(out_dir), str(model_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(json.dumps({"checkpoint_mb": round(checkpoint_mb, 1), "ranks": ranks}, indent=2))

    for report in ranks:
        assert report["world"] == 2 and report["is_fsdp_enabled"] and report["ram_efficient_plugin"]
        assert report["class"] == "Gemma4ForConditionalGeneration"  # what the W1 recipe loads
    rank0, rank1 = ranks
    # measured, not assumed: the rank that read the checkpoint holds at least the bf16 copy,
    # the other stays well below even that
    assert rank0["loaded_mb"] - rank0["baseline_mb"] >= checkpoint_mb / 2
    assert rank1["loaded_mb"] - rank1["baseline_mb"] < checkpoint_mb / 4
    # and the broadcast gave rank 1 the real model: the same logits as the unsharded forward
    for report in ranks:
        assert report["max_logit_diff"] < 1e-2, report
    # every rank's optimizer holds its own shards of the adapters, and one step changes every one of them
    # (with rank 1's model left on the meta device, accelerate mapped all its optimizer entries to one frozen
    # parameter by data_ptr() == 0, and rank 1's adapter shards never trained)
    for report in ranks:
        assert report["trainable"] and all(".lora_" in name for name in report["trainable"]), report["trainable"]
        assert report["optimizer_holds"] == report["trainable"], f"rank {report['rank']}: {report['optimizer_holds']}"
        assert report["changed_by_a_step"] == report["trainable"], f"rank {report['rank']} did not train its shards"


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
