"""Pipeline stages accumulate each microbatch's weight gradient inside its GEMM
(``parallel/pipeline/grad_accumulation.py``): the gradients autograd gives, without a weight-sized
temporary per microbatch, and autograd's own path wherever something relies on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.models import GPT
from lightning_parallel.parallel.pipeline.codegen import lean_stage_code
from lightning_parallel.parallel.pipeline.grad_accumulation import accumulating_linear, gemm_accumulated_weight_grads
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline


class _NewTensors(TorchDispatchMode):
    """Shapes of the tensors that out-of-place ops create (in-place ops and views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if isinstance(out, torch.Tensor) and not schema.is_mutable and not any(a.alias_info for a in schema.returns):
            self.shapes.append(out.shape)
        return out


def _microbatches(linear: nn.Linear, fn: Any, n: int = 3) -> list[_NewTensors]:
    """Forward and backward of ``n`` microbatches through ``fn``; the tensors each backward created."""
    linear.zero_grad(set_to_none=True)
    created = []
    for m in range(n):
        x = torch.randn(2, 5, linear.in_features, generator=torch.Generator().manual_seed(m), requires_grad=True)
        out = fn(x, linear.weight, linear.bias)
        with _NewTensors() as mode:
            out.pow(2).sum().backward()
        created.append(mode)
    return created


def test_gradients_equal_autograds_with_no_weight_sized_temporary_after_the_first_microbatch() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 24)
    _microbatches(linear, F.linear)
    expected = (linear.weight.grad.clone(), linear.bias.grad.clone())
    with gemm_accumulated_weight_grads():
        created = _microbatches(linear, accumulating_linear)
    torch.testing.assert_close(linear.weight.grad, expected[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(linear.bias.grad, expected[1], rtol=1e-6, atol=0)
    weight_sized = [sum(s == linear.weight.shape for s in mode.shapes) for mode in created]
    assert weight_sized == [1, 0, 0], weight_sized  # the first microbatch's GEMM output becomes .grad
    unfused = _microbatches(linear, F.linear)  # the check can fail: autograd makes one every microbatch
    assert [sum(s == linear.weight.shape for s in mode.shapes) for mode in unfused] == [1, 1, 1]


def test_autograds_own_path_where_something_relies_on_it() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    assert "Accumulating" not in type(accumulating_linear(x, linear.weight, linear.bias).grad_fn).__name__  # off by default
    with gemm_accumulated_weight_grads(False):
        assert "Accumulating" not in type(accumulating_linear(x, linear.weight, linear.bias).grad_fn).__name__
    with gemm_accumulated_weight_grads():
        _fallbacks_in_a_schedule(linear, x)


def _fallbacks_in_a_schedule(linear: nn.Linear, x: torch.Tensor) -> None:
    fused = accumulating_linear(x, linear.weight, linear.bias)
    assert fused.grad_fn is not None and "Accumulating" in type(fused.grad_fn).__name__
    with torch.no_grad():
        assert accumulating_linear(x, linear.weight, linear.bias).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = accumulating_linear(x, linear.weight, linear.bias)
    assert out.dtype == torch.bfloat16 and "Accumulating" not in type(out.grad_fn).__name__
    seen: list[int] = []
    linear.weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    out = accumulating_linear(x, linear.weight, linear.bias)
    assert "Accumulating" not in type(out.grad_fn).__name__
    out.sum().backward()
    assert seen == [1], "a post-accumulate-grad hook (DDP's kind) still runs"
    frozen = nn.Linear(8, 8).requires_grad_(False)
    out = accumulating_linear(x, frozen.weight, frozen.bias)
    out.sum().backward()
    assert frozen.weight.grad is None and x.grad is not None


def _backward_nodes(loss: torch.Tensor, name: str) -> int:
    """How many nodes of ``loss``'s autograd graph are called ``name``."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        todo.extend(n for n, _ in node.next_functions)
    return count


@pytest.mark.parametrize("microbatches", [1, 3])
def test_lean_training_stages_use_it_and_give_the_same_gradients(microbatches: int) -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    x = torch.randint(0, 32, (4, 8))
    traced = trace_pipeline(model, (x,), plan=plan_pipeline(model, 2), microbatches=2, build_eval=False)
    stages = [traced.train.get_stage_module(k) for k in range(2)]

    def grads() -> tuple[dict[str, torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        fused = 0
        for m in range(microbatches):
            chunk = x[2 * (m % 2) : 2 * (m % 2) + 2]  # the traced microbatch size
            loss = F.cross_entropy(stages[1](stages[0](chunk)).flatten(0, 1), chunk.flatten())
            fused = _backward_nodes(loss, "_AccumulatingLinearBackward")
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, fused

    before, none = grads()
    assert none == 0
    lean_stage_code(stages)
    targets = [n.target for s in stages for n in s.graph.nodes if n.op == "call_function"]
    assert targets.count(accumulating_linear) == 4 * 6 + 1 and F.linear not in targets  # q k v proj fc proj, lm_head
    with gemm_accumulated_weight_grads():
        after, fused = grads()
    assert fused == 4 * 6 + 1, fused
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
