"""Weight gradients added into ``.grad`` by the matmul that computes them, in pipeline stages.

Why: a pipeline stage runs the backward of several microbatches per step, and autograd computes
each linear layer's weight gradient into a fresh temporary, which ``AccumulateGrad`` then adds into
``.grad`` and frees. Those temporaries are as large as the weights (4 MiB for a 512 x 2048 fp32
layer) while a microbatch's activations are small (64 tokens x 512 x 4 bytes = 128 KiB), so they are
most of what a stage allocates and frees per step. With glibc's mmap threshold pinned (issue 29,
:mod:`lightning_parallel.parallel.allocator`: it keeps freed buffers from staying resident) each of them
is a fresh ``mmap`` whose pages fault in and a ``munmap``; ``strace -c`` of one stage of the 32 x 512
GPT of ``benchmarks/bench_memory.py``: 5,400 of each per step, 552 MiB of fresh pages, 70% of them
those temporaries of microbatches 2-4, and the step 1.33x that of glibc's dynamic threshold.

Megatron-LM's answer is gradient-accumulation fusion: the weight-gradient GEMM accumulates into the
gradient buffer (``beta=1``). Here: :func:`accumulating_linear` computes ``.grad += grad_out^T @
input`` with one ``addmm_`` (the first microbatch's ``mm`` becomes ``.grad`` itself), so a step
allocates each weight gradient once, as ``.grad``, and nothing per microbatch. The values are those
of autograd up to the order of the additions inside the GEMM (fp32, one rounding per element).

It replaces ``F.linear`` in the traced stages' code (:func:`~.codegen.use_python_bindings`) and is
``F.linear`` itself except inside :func:`gemm_accumulated_weight_grads`, which the pipeline runtime
enters around a schedule's training step (the decision is taken at each forward, so a trace shared
by runtimes of different schedules, or a stage called outside a schedule, is always right). There it
falls back to ``F.linear`` wherever writing ``.grad`` from inside the backward would bypass something that
relies on autograd delivering it: a weight that is not a plain leaf (a DTensor of tensor
parallelism, whose gradient goes through hooks), one with gradient hooks, autocast (mixed dtypes in
the backward; the precision plugin owns the casts), ``torch.compile`` tracing, no gradient. Zero-bubble
schedules split the backward into an input pass and a later weight pass (``torch.autograd.grad`` on
the weights): their runtime does not enter it (:meth:`PipelineRuntime.train_step`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.compat import tensor_has_grad_hooks

_PLAIN = (Tensor, nn.Parameter)
_ON: ContextVar[bool] = ContextVar("gemm_accumulated_weight_grads", default=False)


@contextmanager
def gemm_accumulated_weight_grads(enabled: bool = True) -> Iterator[None]:
    """Within: :func:`accumulating_linear` accumulates weight gradients in its GEMM where safe."""
    token = _ON.set(enabled)
    try:
        yield
    finally:
        _ON.reset(token)


class _AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient into ``weight.grad`` in the GEMM."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(input, weight)
        ctx.weight, ctx.has_bias = weight, bias is not None  # the leaf itself: its .grad is written
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        input, weight = ctx.saved_tensors
        grad_input = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        rows = grad_out.reshape(-1, grad_out.shape[-1]).t()
        flat_input = input.reshape(-1, input.shape[-1])
        param = ctx.weight
        if param.grad is None:
            param.grad = rows.mm(flat_input)
        else:
            param.grad.addmm_(rows, flat_input)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(dim=tuple(range(grad_out.dim() - 1)))
        return grad_input, None, grad_bias


def _fusable(input: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the weight's gradient may be written by the backward itself (see the module doc)."""
    if not (_ON.get() and torch.is_grad_enabled() and weight.requires_grad and weight.grad_fn is None):
        return False  # evaluation, a frozen weight, or a weight computed from others
    if any(t is not None and type(t) not in _PLAIN for t in (input, weight, bias)):
        return False  # DTensor (tensor parallelism) and other subclasses: their gradients go their own way
    grad = weight.grad
    return (
        weight.dtype == input.dtype
        and weight.is_contiguous()
        and not tensor_has_grad_hooks(weight)
        and (grad is None or (type(grad) is Tensor and grad.dtype == weight.dtype and grad.is_contiguous()))
        and not torch.is_autocast_enabled(input.device.type)
        and not torch.compiler.is_compiling()
    )


def accumulating_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)``; in training, the weight's gradient is accumulated into
    ``weight.grad`` by the backward's GEMM where that is safe (see the module doc)."""
    if not _fusable(input, weight, bias):
        return F.linear(input, weight, bias)
    return _AccumulatingLinear.apply(input, weight, bias)


__all__ = ["accumulating_linear", "gemm_accumulated_weight_grads"]
