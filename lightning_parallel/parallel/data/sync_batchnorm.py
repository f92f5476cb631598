"""Synchronised batch norm over the data-parallel group, on any device (gloo/CPU and NCCL/CUDA).

Why not ``torch.nn.SyncBatchNorm``: its forward refuses CPU inputs ("expected input tensor to
be on GPU"), so ``Trainer(sync_batchnorm=True)`` could not be honoured, or tested, on gloo; and
its statistics span ``WORLD`` unless given a group, where tensor and pipeline peers would count
the same samples twice. Here the statistics span the ranks that see different data.

Numerics: one process normalises with the batch mean and the biased variance of its whole
batch. To match it to fp32 round-off the variance is computed in two passes (all-reduce the
per-channel sums and counts, then the sums of squared deviations from the global mean) rather
than from ``E[x^2] - E[x]^2``, which cancels badly when a channel's mean is large against its
spread. The backward all-reduces ``sum(dy * w)`` and ``sum(dy * w * x_hat)`` per channel, so each
rank's input gradient is that of the global-batch objective; parameter gradients stay local
and are averaged by the data-parallel reduction like every other parameter's.

Everything runs on the input's device: the collectives see tensors where the group's backend
expects them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.compat import BatchNormBase


def _channel_sum(x: Tensor) -> Tensor:
    """Sum over every dim but the channel dim (dim 1)."""
    dims = [0, *range(2, x.dim())]
    return x.sum(dim=dims)


def _at_least_fp32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise ``x`` with statistics of the whole data-parallel batch."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ctx.input_dtype = x.dtype
        x = _at_least_fp32(x.contiguous())  # statistics (and the count) of half inputs in fp32
        weight_ = _at_least_fp32(weight) if weight is not None else None
        channels = x.size(1)
        local_count = x.numel() // channels
        stats = torch.cat([_channel_sum(x), x.new_full((1,), float(local_count))])
        dist.all_reduce(stats, group=group)
        count = stats[-1].clone()
        mean = stats[:channels] / count
        centred = x - _bcast(mean, x)
        var_sum = _channel_sum(centred * centred)
        dist.all_reduce(var_sum, group=group)
        var = var_sum / count
        invstd = torch.rsqrt(var + eps)
        x_hat = centred * _bcast(invstd, x)
        out = x_hat
        if weight_ is not None:
            out = out * _bcast(weight_, x)
        if bias is not None:
            out = out + _bcast(_at_least_fp32(bias), x)
        ctx.save_for_backward(x_hat, invstd, weight_, count)
        ctx.param_dtype = weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.mark_non_differentiable(mean, var, count)
        return out.to(ctx.input_dtype), mean, var, count

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        x_hat, invstd, weight, count = ctx.saved_tensors
        grad_out = _at_least_fp32(grad_out.contiguous())
        grad_weight = _channel_sum(grad_out * x_hat) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = _channel_sum(grad_out) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_hat = grad_out * _bcast(weight, grad_out) if weight is not None else grad_out
            sums = torch.cat([_channel_sum(grad_hat), _channel_sum(grad_hat * x_hat)])
            dist.all_reduce(sums, group=ctx.group)
            channels = x_hat.size(1)
            mean_dy, mean_dy_xhat = sums[:channels] / count, sums[channels:] / count
            grad_x = (grad_hat - _bcast(mean_dy, x_hat) - x_hat * _bcast(mean_dy_xhat, x_hat)) * _bcast(invstd, x_hat)
        grad_x = grad_x.to(ctx.input_dtype) if grad_x is not None else None
        grad_weight = grad_weight.to(ctx.param_dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(ctx.param_dtype) if grad_bias is not None else None
        return grad_x, grad_weight, grad_bias, None, None


class DataParallelBatchNorm(BatchNormBase):
    """``BatchNorm1d/2d/3d`` whose training statistics span a data-parallel process group.

    Same parameters, buffers and names as the module it replaces (checkpoints load either way).
    Outside training, with no group, or with a group of one it is the plain batch norm.
    """

    def __init__(self, *args: Any, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _synchronised(self) -> bool:
        return (self.process_group is not None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        bn_training = self.training or self.running_mean is None
        if not (bn_training and self._synchronised()):
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        out, mean, var, count = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, self.process_group)
        if self.training and self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():  # as F.batch_norm: unbiased variance in the running estimate
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        return out


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None) -> tuple[nn.Module, list[str]]:
    """Replace every BatchNorm (not already synchronised) by :class:`DataParallelBatchNorm` over
    ``process_group``, keeping the same ``Parameter`` objects and buffers; returns the new root
    (a BatchNorm root is itself replaced) and the names converted."""
    converted: list[str] = []

    def convert(child: nn.Module, name: str) -> nn.Module:
        if isinstance(child, BatchNormBase) and not isinstance(child, (DataParallelBatchNorm, nn.SyncBatchNorm)):
            new = DataParallelBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                        child.track_running_stats, process_group=process_group)
            if child.affine:
                new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            new.train(child.training)
            if hasattr(child, "qconfig"):
                new.qconfig = child.qconfig
            converted.append(name)
            return new
        for child_name, grandchild in list(child.named_children()):
            replacement = convert(grandchild, f"{name}.{child_name}" if name else child_name)
            if replacement is not grandchild:
                setattr(child, child_name, replacement)
        return child

    root = convert(module, "")
    return root, converted


def uses_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, BatchNormBase) for m in module.modules())


__all__ = ["DataParallelBatchNorm", "convert_sync_batchnorm", "uses_batchnorm"]
