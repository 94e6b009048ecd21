"""`make demo` end to end: the real Gemma 3 270M, a few training steps, a real server on 127.0.0.1, a real request.

And the promise that matters on a laptop: whatever fails, nothing is left running.

    .venv/bin/python -m pytest -q tests/e2e
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from demo import pipeline as demo
from demo.local_server import PortBusyError, check_port_free
from serving.vllm_args import COMPLETION_MARKER
from tests.tiny_models import build_tiny_gemma

REPO = Path(__file__).resolve().parents[2]


def _server_pids(needle: str) -> list[int]:
    """Running local servers whose command line mentions `needle` (a test's own folder).

    A child this process has just started reads an empty command line until the kernel has set up its
    new program (Popen returns once exec has begun; measured here under load: 8 of 40 starts read
    empty at once), so a child's empty one is read again for a moment.
    """
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        deadline = time.monotonic() + 2
        try:
            while True:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]  # after "(name)"
                if cmdline or state == "Z" or int(ppid) != os.getpid() or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        except OSError:
            continue
        if "demo.local_server" in cmdline and needle in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def _tensor(folder: Path, suffix: str) -> Any:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if key.endswith(suffix):
                    return f.get_tensor(key)
    raise AssertionError(f"no tensor ending in {suffix} in {folder}")


@pytest.fixture(scope="module")
def demo_270m_on_the_users_file(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path, list[str]]:
    """ONE real `make demo DATA=my.jsonl` run on the 270M (a subprocess, as the user runs it), read by two tests.

    The 270M is trained and served once per module instead of twice: the default data path (emoji-local, the seed
    prompt, emoji F1) is the same orchestration, proven on a tiny model below, and emoji-local on the real 270M
    is trained, merged and scored in tests/trainer/test_local_model.py.
    """
    tmp_path = tmp_path_factory.mktemp("demo-270m")
    (tmp_path / "my.jsonl").write_text(TICKETS.read_text())
    out = tmp_path / "demo"
    argv = ["--data", str(tmp_path / "my.jsonl"), "--max-steps", "2", "--eval-samples", "2", "--port", "0",
            "--max-tokens", "8", "--output-dir", str(out)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "demo.pipeline", *argv],
        # a bound, not an expectation: the run takes a few minutes on 2 busy cores
        cwd=REPO, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    return done, out, argv


@pytest.mark.slow
@pytest.mark.gemma3_270m
def test_demo_pipeline(demo_270m_on_the_users_file: tuple[subprocess.CompletedProcess[str], Path, list[str]]) -> None:
    """The real 270M end to end: the report, the real HTTP answer, an export that LoRA changed, nothing left running."""
    done, out, _ = demo_270m_on_the_users_file
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # the report: answer, scores, outputs, next steps
    assert "Answer : " in done.stdout and "Before : " in done.stdout and "After  : " in done.stdout
    assert "pulumi config set --secret hfToken" in done.stdout and "pulumi destroy" in done.stdout

    # the real HTTP response, as the client received it
    summary = json.loads((out / "demo_summary.json").read_text())
    response = summary["response"]
    assert response["object"] == "chat.completion" and response["model"] == "gemma"
    choice = response["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"] == summary["answer"]
    assert choice["finish_reason"] in {"stop", "length"}
    assert 0 < response["usage"]["completion_tokens"] <= 8

    # scores before and after, on the same rows
    assert summary["before"]["samples"] == summary["after"]["samples"] == 2
    assert summary["after"]["held_out_loss"] is not None

    # exported as the cloud expects, and actually trained
    merged, base = out / "merged", Path(summary["paths"]["base_model"])
    assert (merged / COMPLETION_MARKER).is_file() and (merged / "config.json").is_file()
    _assert_lora_merged(merged, base)

    # the loss curve and the trainer's run summary
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    run_summary = json.loads((out / "run_summary.json").read_text())
    assert run_summary["steps"] == 2

    # nothing left running
    assert _server_pids(str(out)) == []


def _assert_lora_merged(merged: Path, base: Path) -> None:
    """The merged LoRA target differs from the base; a weight LoRA does not target is the base's, bit for bit."""
    merged_q = _tensor(merged, "layers.0.self_attn.q_proj.weight")
    base_q = _tensor(base, "layers.0.self_attn.q_proj.weight").to(merged_q.dtype)
    assert merged_q.shape == base_q.shape
    assert (merged_q.float() - base_q.float()).abs().max().item() > 0, (
        "the merged LoRA target equals the base: the adapter did not change anything"
    )
    untouched_m, untouched_b = (
        _tensor(merged, "layers.0.mlp.down_proj.weight"),
        _tensor(base, "layers.0.mlp.down_proj.weight"),
    )
    assert (untouched_m.float() - untouched_b.to(untouched_m.dtype).float()).abs().max().item() == 0, (
        "a weight LoRA does not target changed: the merge is not what the recipe trained"
    )


def _fake_pipeline(monkeypatch: pytest.MonkeyPatch, model_dir: Path, failure: BaseException) -> dict[str, Any]:
    """The real orchestration and a real server on a tiny model; the slow parts faked; `failure` raised once the server answers."""
    import trainer.local_model
    from trainer.train import RunResult

    seen: dict[str, Any] = {}
    monkeypatch.setattr(trainer.local_model, "ensure_local_model", lambda *a, **k: model_dir)
    monkeypatch.setattr(demo, "score", lambda *a, **k: {"emoji_f1": 0.0, "held_out_loss": 1.0, "samples": 1})
    monkeypatch.setattr(demo, "train", lambda recipe: (RunResult(recipe.output.dir, "adapter", str(model_dir), {}), []))

    def failing_request(url: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from serving.client import list_models

        assert list_models(url) == ["gemma"], "the server is up when the failure happens"
        seen["port"] = int(url.rsplit(":", 1)[1])
        raise failure

    monkeypatch.setattr(demo, "chat_completion", failing_request)
    return seen


@pytest.mark.parametrize(
    ("failure", "exit_code", "message"),
    [
        (RuntimeError("injected failure after the server started"), None, "injected failure"),
        (KeyboardInterrupt(), 130, "interrupted: nothing is left running"),
    ],
)
def test_failure_after_the_server_started_leaves_nothing_running(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: BaseException,
    exit_code: int | None,
    message: str,
) -> None:
    model_dir = build_tiny_gemma(tmp_path / "tiny-merged")
    seen = _fake_pipeline(monkeypatch, model_dir, failure)
    argv = ["--port", "0", "--max-steps", "2", "--output-dir", str(tmp_path / "demo")]
    if exit_code is None:
        with pytest.raises(RuntimeError, match=message):
            demo.main(argv)
    else:
        assert demo.main(argv) == exit_code
        assert message in capsys.readouterr().err
    assert "port" in seen, "the failure was injected after the server answered"
    assert _server_pids(str(model_dir)) == [], "the local server is still running"
    _wait_port_free(seen["port"])


# the run that succeeds (scoring_fails=False) is the real default demo below, which checks the same overlap
@pytest.mark.parametrize("scoring_fails", [True])
def test_the_server_loads_while_the_fine_tuned_model_is_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scoring_fails: bool
) -> None:
    """The server's start-up overlaps step 5, and a failure there still leaves nothing running."""
    import trainer.local_model
    from trainer.train import RunResult

    model_dir = build_tiny_gemma(tmp_path / "tiny-merged")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(trainer.local_model, "ensure_local_model", lambda *a, **k: model_dir)
    monkeypatch.setattr(demo, "train", lambda recipe: (RunResult(recipe.output.dir, "adapter", str(model_dir), {}), []))

    def scoring(model: Path, recipe: Any, out: Path, **kwargs: Any) -> dict[str, Any]:
        if out.name == "eval_after.json":
            seen["servers"] = _server_pids(str(model_dir))
            if scoring_fails:
                raise RuntimeError("injected failure while scoring")
        return {"emoji_f1": 0.0, "held_out_loss": 1.0, "samples": 1}

    monkeypatch.setattr(demo, "score", scoring)
    argv = ["--port", "0", "--max-steps", "2", "--max-tokens", "4", "--output-dir", str(tmp_path / "demo")]
    if scoring_fails:
        with pytest.raises(RuntimeError, match="injected failure while scoring"):
            demo.main(argv)
    else:
        assert demo.main(argv) == 0
        assert json.loads((tmp_path / "demo" / "demo_summary.json").read_text())["response"]["model"] == "gemma"
    assert len(seen["servers"]) == 1, "the server was not running while the fine-tuned model was scored"
    assert _server_pids(str(model_dir)) == [], "the local server is still running"


def _wait_port_free(port: int, timeout_s: float = 30) -> None:
    """The process is gone; on a busy machine the kernel may take a moment longer to release its socket."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_port_free("127.0.0.1", port)
            return
        except PortBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_sigterm_becomes_an_interrupt() -> None:
    """`kill PID` (CI cancelling a job) takes the same clean-up path as Ctrl-C."""
    with pytest.raises(KeyboardInterrupt):
        demo._sigterm_to_interrupt(15, None)


# --------------------------------------------------------------------------- the user's own data (docs/own-data.md)

TICKETS = REPO / "trainer/samples/own/tickets-messages.jsonl"


def _own_recipe(tmp_path: Path, model: str) -> Path:
    """The user's copy of the local template, in their own folder, naming `model`."""
    text = (REPO / "trainer/recipes/templates/my-data-local.yaml").read_text().replace("local:gemma3-270m", model)
    (tmp_path / "mine.yaml").write_text(text)
    return tmp_path / "mine.yaml"


def test_the_base_scores_of_a_standard_format_have_a_key(tmp_path: Path) -> None:
    """`score_key` read `data.task.value`, which a messages recipe does not have (None)."""
    from trainer.recipe import load_recipe

    model_dir = build_tiny_gemma(tmp_path / "tiny")
    recipe = load_recipe(str(_own_recipe(tmp_path, str(model_dir))), ["evaluation.max_samples=2"])
    assert recipe.data.task is None
    key = demo.score_key(model_dir, recipe)
    other = load_recipe(str(_own_recipe(tmp_path, str(model_dir))), ["evaluation.max_samples=3"])
    assert len(key) == 20 and demo.score_key(model_dir, other) != key, "the held-out rows are part of the key"


def test_data_names_a_file_and_its_format_is_read_from_the_rows(tmp_path: Path) -> None:
    # enough rows for the template's held-out slice and one batch (a smaller file is refused, with the numbers)
    rows = [{"prompt": f"Ticket: late parcel {i}", "completion": "shipping"} for i in range(20)]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = demo.build_recipe(demo.DemoOptions(output_dir=tmp_path / "out", data=str(tmp_path / "pc.jsonl")))
    assert recipe.name == "my-data-local" and recipe.data.format.value == "prompt-completion"
    assert recipe.data.path == str(tmp_path / "pc.jsonl") and recipe.output.dir == str(tmp_path / "out")
    (tmp_path / "flat.csv").write_text("ticket,category\n" + "".join(f"late parcel {i},shipping\n" for i in range(20)))
    with pytest.raises(demo.DemoError, match=r"data\.columns"):
        demo.build_recipe(demo.DemoOptions(output_dir=tmp_path / "out", data=str(tmp_path / "flat.csv")))


def test_a_recipe_whose_model_is_not_here_is_refused_before_anything_slow(tmp_path: Path) -> None:
    recipe = demo.build_recipe(
        demo.DemoOptions(output_dir=tmp_path / "o", recipe=str(_own_recipe(tmp_path, "google/x")))
    )
    with pytest.raises(demo.DemoError, match="not on this machine"):
        demo.base_model_dir(recipe)


@pytest.mark.slow
def test_the_demo_trains_scores_and_serves_the_users_file(tmp_path: Path) -> None:
    """`make demo RECIPE=mine.yaml DATA=tickets.jsonl` on a tiny model: the real trainer, evaluator, server, client."""
    model_dir = build_tiny_gemma(tmp_path / "tiny")
    (tmp_path / "tickets.jsonl").write_text(TICKETS.read_text())
    out = tmp_path / "demo"
    argv = ["--recipe", str(_own_recipe(tmp_path, str(model_dir))), "--data", str(tmp_path / "tickets.jsonl"),
            "--max-steps", "2", "--eval-samples", "2", "--max-tokens", "4", "--port", "0", "--output-dir", str(out)]  # fmt: skip
    assert demo.main(argv) == 0
    summary = json.loads((out / "demo_summary.json").read_text())
    first_held_out = demo.seed_messages(demo.build_recipe(demo._parse_args(argv)))
    assert summary["messages"] == first_held_out and first_held_out[0]["role"] == "system"
    assert summary["prompt"].startswith("Product: ") and "Ticket:" in summary["prompt"]
    assert (
        summary["response"]["model"] == "gemma" and summary["response"]["choices"][0]["message"]["role"] == "assistant"
    )
    for side in ("before", "after"):
        assert summary[side]["samples"] == 2 and 0 <= summary[side]["rouge_l_f1"] <= 1
        assert 0 <= summary[side]["exact_match"] <= 1 and summary[side]["held_out_loss"] > 0
    run_summary = json.loads((out / "run_summary.json").read_text())
    assert run_summary["recipe"] == "my-data-local" and run_summary["steps"] == 2
    assert (out / "merged" / COMPLETION_MARKER).is_file()
    assert _server_pids(str(out)) == []


@pytest.mark.slow
def test_the_default_demo_trains_scores_and_serves_the_emoji_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make demo` without DATA: emoji-local, the seed prompt, emoji F1; the real trainer, evaluator, server and
    client, a tiny model standing in for the built 270M (which the 270M tests above and test_local_model.py run):
    it lies in the cache as a finished build, which the demo finds and the trainer resolves `local:` to."""
    from trainer.model_files import BUILD_MARKER

    monkeypatch.setenv("GEMMA_FT_CACHE", str(tmp_path / "cache"))  # the tiny base's scores stay out of the real cache
    model_dir = build_tiny_gemma(tmp_path / "cache" / "gemma3-270m")
    (model_dir / BUILD_MARKER).write_text("{}")
    out = tmp_path / "demo"
    real_score, servers_while_scoring_after = demo.score, []

    def scoring(model: Path, recipe: Any, result_file: Path, **kwargs: Any) -> dict[str, Any]:
        if result_file.name == "eval_after.json":
            servers_while_scoring_after.append(_server_pids(str(out)))
        return real_score(model, recipe, result_file, **kwargs)

    monkeypatch.setattr(demo, "score", scoring)
    argv = ["--max-steps", "2", "--eval-samples", "2", "--max-tokens", "8", "--port", "0", "--output-dir", str(out)]
    assert demo.main(argv) == 0
    assert [len(pids) for pids in servers_while_scoring_after] == [1], (
        "the server was not running while the fine-tuned model was scored"
    )
    stdout = capsys.readouterr().out
    assert "Before : emoji F1" in stdout and "After  : emoji F1" in stdout
    assert "pulumi config set --secret hfToken" in stdout and "pulumi destroy" in stdout
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["prompt"] == demo.SEED_PROMPT and summary["messages"] == [
        {"role": "user", "content": demo.SEED_PROMPT}
    ]
    response = summary["response"]
    assert response["model"] == "gemma" and response["choices"][0]["message"]["content"] == summary["answer"]
    assert 0 < response["usage"]["completion_tokens"] <= 8
    for side in ("before", "after"):
        assert summary[side]["samples"] == 2 and 0 <= summary[side]["emoji_f1"] <= 1
    assert summary["after"]["held_out_loss"] is not None
    run_summary = json.loads((out / "run_summary.json").read_text())
    assert run_summary["recipe"] == "emoji-local" and run_summary["model"] == "local:gemma3-270m"
    assert run_summary["steps"] == 2
    assert (out / "merged" / COMPLETION_MARKER).is_file() and Path(summary["paths"]["base_model"]) == model_dir
    _assert_lora_merged(out / "merged", model_dir)
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert _server_pids(str(out)) == []


@pytest.mark.slow
@pytest.mark.gemma3_270m
def test_make_demo_data_fine_tunes_the_270m_on_the_users_file(
    demo_270m_on_the_users_file: tuple[subprocess.CompletedProcess[str], Path, list[str]],
) -> None:
    """`make demo DATA=my.jsonl`, as the user types it: the real 270M on this CPU, on their file."""
    done, out, argv = demo_270m_on_the_users_file
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Before : ROUGE-L F1" in done.stdout and "After  : ROUGE-L F1" in done.stdout
    summary = json.loads((out / "demo_summary.json").read_text())
    first_held_out = demo.seed_messages(demo.build_recipe(demo._parse_args(argv)))
    assert summary["messages"] == first_held_out and summary["prompt"] == first_held_out[-1]["content"]
    assert summary["run_summary"]["recipe"] == "my-data-local" and summary["run_summary"]["steps"] == 2
    assert summary["run_summary"]["model"] == "local:gemma3-270m"
    assert summary["after"]["samples"] == 2 and summary["after"]["held_out_loss"] is not None
    assert summary["response"]["choices"][0]["message"]["role"] == "assistant"
    assert _server_pids(str(out)) == []
