"""torch's own context-parallel attention, where its one mask applies (CUDA, flash kernels).

Why: torch.distributed's experimental context parallelism runs each block of a ring through the
fused flash kernel and merges the blocks by log-sum-exp, in forward and backward. Its public
entry (``context_parallel``) shards whole buffers and patches SDPA for a model, which cannot take
this package's chunks, padding or windows; its block engine (``_templated_ring_attention`` and
its backward) can, for exactly the mask it implements: causal, over the head-tail chunks it
load-balances by, which is this package's layout (``chunks.py``, rank r holds chunks r and
2cp-1-r). So where the step's mask is that one (causal, no padding, no sliding window), the
``"allgather"`` and ``"ring"`` forms on CUDA in half precision call torch's engine with its
all-gather or all-to-all key/value rotation; everything else (fp32 on CUDA, padding, windows,
bidirectional attention, the CPU) runs this package's own forms (``attention.py``).

On the CPU the same engine runs with the CPU flash kernel (which returns the log-sum-exp the merge
needs): that is how the tests check this path on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.compat import (
    flash_attention_ops,
    templated_ring_attention,
    templated_ring_attention_backward,
    torch_ring_rotation,
)

ROTATION = {"allgather": "ALL_GATHER", "ring": "ALL_TO_ALL"}  # the form -> torch's key/value rotation


@dataclass(frozen=True)
class _Kernels:
    """One device's flash kernels and how torch's engine passes their extra arguments."""

    forward: Any
    backward: Any
    forward_kwargs: tuple[tuple[str, Any], ...]
    rest_names: tuple[str, ...]  # the forward's outputs after (out, lse), by the backward's argument names


def _kernels(device_type: str) -> _Kernels:
    forward, backward = flash_attention_ops(device_type)
    if device_type == "cpu":
        return _Kernels(forward, backward, (("dropout_p", 0.0),), ())
    return _Kernels(forward, backward, (("dropout_p", 0.0), ("return_debug_mask", False)),
                    ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"))


def torch_ring_applies(form: str, q: Tensor, key_valid: Tensor | None, causal: bool, window: int | None) -> bool:
    """Whether the step runs torch's engine: a causal mask and nothing else, on CUDA, where the flash
    kernel takes the dtype and head size (fp16/bf16, head dim a multiple of 8 up to 256)."""
    return (form in ROTATION and causal and key_valid is None and window is None and q.device.type == "cuda"
            and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0 and q.size(-1) <= 256)


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, form: str, scale: float) -> Tensor:
        kernels = _kernels(q.device.type)
        with torch_ring_rotation(ROTATION[form]):
            out, lse, *rest = templated_ring_attention(group, 2, kernels.forward, q, k, v, is_causal=True, scale=scale,
                                                       **dict(kernels.forward_kwargs))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rest = dict(zip(kernels.rest_names, rest))
        ctx.group, ctx.form, ctx.scale, ctx.kernels = group, form, scale, kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        kernels: _Kernels = ctx.kernels
        with torch_ring_rotation(ROTATION[ctx.form]):
            dq, dk, dv, *_ = templated_ring_attention_backward(
                ctx.group, 2, kernels.backward, grad_out=grad_out.contiguous(), grad_out_name="grad_out",
                query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0, scale=ctx.scale, **ctx.rest,
            )
        return dq, dk, dv, None, None, None


def torch_ring_attention(form: str, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
    """``[B, H, S_local, D]`` causal attention of the local queries over the whole sequence through torch's
    engine (``q``/``k``/``v`` hold this rank's head-tail chunks; grouped keys and values are repeated to the
    query heads, the kernels take equal head counts, and autograd sums their gradients back)."""
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    return _TorchRing.apply(q, k, v, group, form, scale)
