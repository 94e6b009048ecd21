"""trainer/cpu_logprob.py gives what trl's own head kernel gives: every output and every gradient.

Each case runs the same rows through trl 1.16's `ChunkedLogProbFunction` (its CPU path: torch tiles)
and through `LabelledRowsLogProb`, with a loss that uses the log-probabilities and, where trl supports
it, the entropy, and compares the five outputs and the gradients of the hidden rows, the weight and the
bias. The vocabulary is small but spans several of trl's tiles and several of ours.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import trainer.cpu_logprob as cpu_logprob
from trainer.cpu_logprob import LabelledRowsLogProb, keep_logits_bytes, project

ALL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tiles of 5 rows over a 3,000-word vocabulary, so a handful of rows crosses tile boundaries."""
    monkeypatch.setattr(cpu_logprob, "TILE_BYTES", 5 * 3000 * 4)
    yield


def _inputs(rows: int, vocab: int = 3000, width: int = 24, bias: bool = False, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(rows, width, generator=generator),
        "weight": torch.randn(vocab, width, generator=generator) * 0.5,
        "bias": torch.randn(vocab, generator=generator) if bias else None,
        "targets": torch.randint(0, vocab, (rows,), generator=generator),
    }


def _run(kernel: Any, inputs: dict[str, Any], settings: dict[str, Any], entropy_weight: float) -> dict[str, Any]:
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k != "targets" and v is not None}
    outputs = kernel.apply(
        leaves["hidden"],
        leaves["weight"],
        leaves.get("bias"),
        inputs["targets"],
        settings.get("temperature", 1.0),
        1024,  # trl's vocabulary tile: three tiles over 3,000 words
        settings.get("softcap"),
        settings.get("logit_scale", 1.0),
        settings.get("outputs", ALL),
    )
    logprobs, entropy = outputs[0], outputs[1]
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.shape[0])).sum()
    if entropy_weight:
        loss = loss + entropy_weight * (entropy * torch.linspace(1.0, 2.0, entropy.shape[0])).sum()
    if loss.requires_grad:
        loss.backward()
    return {"outputs": outputs, "grads": {k: v.grad for k, v in leaves.items()}}


def _assert_same(ours: dict[str, Any], trls: dict[str, Any], gradients: bool = True) -> None:
    for index, (got, want) in enumerate(zip(ours["outputs"], trls["outputs"], strict=True)):
        if want is None:
            assert got is None, index
        elif want.dtype == torch.bool:
            assert torch.equal(got, want), index
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"output {index}")
    if not gradients:
        return
    assert ours["grads"].keys() == trls["grads"].keys()
    for name, want in trls["grads"].items():
        got = ours["grads"][name]
        assert got is not None and want is not None, name
        if want.numel() == 0:
            assert got.shape == want.shape, name
            continue
        scale = max(float(want.abs().max()), 1.0)  # a gradient that is zero in exact arithmetic is float noise in both
        assert float((got - want).abs().max()) <= 1e-5 * scale, name


CASES = {
    "plain": {},
    "softcap, scale, temperature": {"softcap": 30.0, "logit_scale": 0.8, "temperature": 0.7},
    "log-probs only": {"outputs": ()},
    "entropy only": {"outputs": ("entropy",)},
}


# the entropy term in the loss only where the entropy is an output
LOSSES = [(case, w) for case in CASES for w in (0.0, 0.3) if not w or "entropy" in CASES[case].get("outputs", ALL)]


@pytest.mark.parametrize(("case", "entropy_weight"), LOSSES)
@pytest.mark.parametrize("rows", [1, 12])
def test_outputs_and_gradients_equal_trls(case: str, entropy_weight: float, rows: int) -> None:
    settings = CASES[case]
    inputs = _inputs(rows)
    _assert_same(
        _run(LabelledRowsLogProb, inputs, settings, entropy_weight),
        _run(ChunkedLogProbFunction, inputs, settings, entropy_weight),
    )


@pytest.mark.parametrize("rows", [3, cpu_logprob.SMALL_ROWS, 30])
def test_both_orientations_of_the_hidden_gradient_equal_trls(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """One tile of all the rows: fewer than SMALL_ROWS take `grad.T @ weight`, the others `(weight.T @ grad).T`."""
    monkeypatch.setattr(cpu_logprob, "TILE_BYTES", 30 * 3000 * 4)
    seen: list[int] = []
    original = cpu_logprob._hidden_grad

    def spy(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad.shape[1])
        return original(weight, grad)

    monkeypatch.setattr(cpu_logprob, "_hidden_grad", spy)
    inputs = _inputs(rows, bias=True)
    settings = {"softcap": 30.0}
    _assert_same(_run(LabelledRowsLogProb, inputs, settings, 0.3), _run(ChunkedLogProbFunction, inputs, settings, 0.3))
    assert seen == [rows], "one tile, one gradient product"


def test_bias_and_a_trained_head_get_their_gradients() -> None:
    inputs = _inputs(7, bias=True)
    settings = {"softcap": 15.0}
    ours = _run(LabelledRowsLogProb, inputs, settings, 0.2)
    _assert_same(ours, _run(ChunkedLogProbFunction, inputs, settings, 0.2))
    assert ours["grads"]["bias"].abs().max() > 0 and ours["grads"]["weight"].abs().max() > 0


def test_projecting_again_in_the_backward_gives_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above KEEP_LOGITS_BYTES the logits are not kept; the backward recomputes them, as trl does."""
    inputs = _inputs(12, bias=True)
    kept = _run(LabelledRowsLogProb, inputs, {"softcap": 30.0}, 0.3)
    monkeypatch.setattr(cpu_logprob, "KEEP_LOGITS_BYTES", 0)
    recomputed = _run(LabelledRowsLogProb, inputs, {"softcap": 30.0}, 0.3)
    _assert_same(recomputed, kept)


def test_a_tie_counts_as_top1_only_for_the_first_word() -> None:
    """trl counts a target as top-1 only when no earlier word has the same logit (argmax's first maximum)."""
    inputs = _inputs(2)
    inputs["weight"][10] = inputs["weight"][20] = inputs["hidden"][0] * 5  # words 10 and 20 tie, far above the rest
    inputs["weight"][30] = inputs["weight"][40] = inputs["hidden"][1] * 5
    inputs["targets"] = torch.tensor([10, 40])
    ours = _run(LabelledRowsLogProb, inputs, {}, 0.0)
    # the gradients are 0 in exact arithmetic (two equal words share the probability) and float noise in both
    _assert_same(ours, _run(ChunkedLogProbFunction, inputs, {}, 0.0), gradients=False)
    assert ours["outputs"][4].tolist() == [True, False]


def test_no_rows() -> None:
    """A micro-batch without labels: empty outputs, zero gradients, as trl."""
    inputs = _inputs(0)
    ours = _run(LabelledRowsLogProb, inputs, {}, 0.0)
    _assert_same(ours, _run(ChunkedLogProbFunction, inputs, {}, 0.0))
    assert ours["outputs"][0].shape == (0,)


@pytest.mark.parametrize("rows", [9, 30])
def test_autocast_bfloat16_matches_trl(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """Under CPU autocast both project in bfloat16 and do the softmax in float32 (one tile of all the rows:
    both orientations of the hidden-state gradient)."""
    monkeypatch.setattr(cpu_logprob, "TILE_BYTES", 30 * 3000 * 4)
    inputs = _inputs(rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _run(LabelledRowsLogProb, inputs, {}, 0.0)
        trls = _run(ChunkedLogProbFunction, inputs, {}, 0.0)
    torch.testing.assert_close(ours["outputs"][0], trls["outputs"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours["grads"]["hidden"], trls["grads"]["hidden"], rtol=5e-2, atol=5e-2)


def test_the_backward_uses_the_forwards_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles are the forward's even if the tile size reads differently by the backward (a ZeRO-3 weight
    reads as empty outside its gather)."""
    inputs = _inputs(12)

    def hidden_grad(retile: bool) -> torch.Tensor:
        hidden = inputs["hidden"].clone().requires_grad_(True)
        logprobs, *_ = LabelledRowsLogProb.apply(hidden, inputs["weight"], None, inputs["targets"], 1.0, 1024)
        if retile:
            monkeypatch.setattr(cpu_logprob, "TILE_BYTES", 7 * 3000 * 4)  # other tiles after the forward
        (-logprobs.sum()).backward()
        assert hidden.grad is not None
        return hidden.grad

    reference = hidden_grad(retile=False)
    torch.testing.assert_close(hidden_grad(retile=True), reference, rtol=0, atol=0)


def test_no_second_derivative() -> None:
    """trl's kernel cannot be differentiated twice either; ours says so instead of returning a graph-less gradient."""
    inputs = _inputs(3)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    logprobs, *_ = LabelledRowsLogProb.apply(hidden, inputs["weight"], None, inputs["targets"], 1.0, 1024)
    (grad,) = torch.autograd.grad(logprobs.sum(), hidden, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_project_under_no_grad_gives_the_same_outputs() -> None:
    """Evaluation calls it under no_grad (no logits kept then); training with grad: the same numbers."""
    inputs = _inputs(9)
    args = (inputs["weight"], None, inputs["targets"], 1.0, 1024, None, 1.0, ALL)
    with torch.no_grad():
        quiet = project(inputs["hidden"], *args)
    loud = project(inputs["hidden"].clone().requires_grad_(True), *args)
    for got, want in zip(quiet, loud, strict=True):
        assert torch.equal(got, want.detach())


def test_the_kept_logits_budget_is_shared_by_the_machines_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = keep_logits_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert keep_logits_bytes() == alone // 8
