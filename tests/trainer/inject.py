"""What the multi-process tests share: the sitecustomize code they inject, the launcher's argv and environment.

`AFTER_IMPORT` defines `_after_import(module_name, patch)`: patch a module right after the program first
imports it, without importing it earlier than the program would (an early import of transformers would
change when each rank gets anywhere). The tests prepend it to their own sitecustomize code.
`launch_argv` / `launch_env`: `python -m trainer.launch --cpu` (accelerate launch -> torchrun, gloo on
loopback), with that sitecustomize first on PYTHONPATH; `w1_overrides`: the W1 recipe on a tiny model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from demo.local_server import free_port

REPO = Path(__file__).resolve().parents[2]

AFTER_IMPORT = """
import importlib.abc
import importlib.util
import sys


def _after_import(module_name, patch):
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())
"""


def launch_argv(recipe: str, nproc: int, config_out: Path, overrides: list[str]) -> list[str]:
    """The launcher on `nproc` CPU ranks with a free rendezvous port; each override a `--set`."""
    argv = [sys.executable, "-m", "trainer.launch", "--recipe", recipe, "--nproc-per-node", str(nproc)]
    argv += ["--cpu", "--main-process-port", str(free_port()), "--config-out", str(config_out)]
    for item in overrides:
        argv += ["--set", item]
    return argv


def launch_env(tmp_path: Path, sitecustomize: str, **variables: str | None) -> dict[str, str]:
    """This environment, offline, one thread a rank, gloo on loopback, `sitecustomize` imported by every
    process; `variables` set (None: unset, so a test's own setting is never inherited)."""
    inject = tmp_path / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(sitecustomize)
    env = {
        **os.environ,
        "PYTHONPATH": f"{inject}{os.pathsep}{REPO}",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for name, value in variables.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


def w1_overrides(model_dir: Path, url: str, nproc: int, max_steps: int, save_steps: int) -> list[str]:
    """The W1 recipe (text-to-sql-gemma4-31b) on a tiny model and the local SQL sample, one row a step."""
    return [
        f"model.name_or_path={model_dir}",
        "model.dtype=float32",
        "data.source=local",
        "data.path=trainer/samples/text_to_sql.jsonl",
        "data.max_rows=110",
        "data.eval_rows=0",
        f"training.max_steps={max_steps}",
        f"training.save_steps={save_steps}",
        "training.eval_steps=null",
        "training.logging_steps=1",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "training.report_to=[]",
        "training.compile=none",  # inductor's C++ build takes minutes per rank on a CPU
        f"distributed.world_size={nproc}",
        f"output.dir={url}",
    ]
