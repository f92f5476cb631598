"""Expert parallelism on the Lightning side: apply, reduce expert gradients, add MoE losses.

Kept apart from the strategy class: the pure-torch work is in
:mod:`lightning_parallel.parallel.experts.apply` and :mod:`lightning_parallel.nn.moe`; this file
is the glue that decides which group reduces what, and how the auxiliary losses reach the loss
Lightning backpropagates without touching the user's ``training_step``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.nn.moe import (
    MoE,
    clear_moe_stats,
    collect_moe_losses,
    collect_moe_stats,
    set_moe_loss_coefs,
    set_moe_stats_group,
)
from lightning_parallel.parallel.dims import EDP, EP, ParallelDims
from lightning_parallel.parallel.experts.apply import apply_expert_parallel, find_expert_modules


def apply_experts(
    module: nn.Module, dims: ParallelDims, aux_coef: float | None, z_coef: float | None
) -> tuple[dict[str, nn.Module], list[nn.Parameter]]:
    """Shard experts over ``ep``; MoE balance losses use global-batch statistics over ``dp`` (x ``cp``).

    Returns the experts modules (FSDP2 shards them over ``edp`` on their own) and their
    parameters (DDP leaves them to :func:`reduce_expert_grads`).
    """
    if aux_coef is not None or z_coef is not None:
        set_moe_loss_coefs(module, aux=aux_coef, z=z_coef)
    tokens = dims.axis(dims.grad_axis) if dims.grad_size > 1 else None  # ranks holding different tokens: dp (x cp)
    if dims.ep == 1:
        if tokens is not None and any(isinstance(m, MoE) for m in module.modules()):
            set_moe_stats_group(module, tokens.get_group())
        return {}, []
    experts = find_expert_modules(module)
    names = set(apply_expert_parallel(module, dims.axis(EP), tokens))
    return experts, [p for n, p in module.named_parameters() if n in names]


def reduce_expert_grads(params: list[nn.Parameter], dims: ParallelDims) -> None:
    """DDP path: expert gradients are averaged over the ranks holding the same experts (edp)."""
    edp = dims.grad_size // dims.ep
    if not params or edp == 1:
        return
    group = dims.axis(EDP).get_group()
    for param in params:
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            dist.all_reduce(grad, group=group)
            grad.div_(edp)


def add_moe_losses(module: Any, output: Any) -> Any:
    """MoE auxiliary losses join the loss Lightning backpropagates; ``training_step`` stays unchanged.

    The user's logged loss stays the task loss; ``moe_aux_loss`` / ``moe_z_loss`` and the
    per-expert token counts are logged beside it (already global: no sync needed).
    """
    losses = collect_moe_losses(module)
    if not losses:
        return output
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        return output
    for key in ("moe_aux_loss", "moe_z_loss"):
        module.log(key, losses[key].detach())
    module.log_dict(collect_moe_stats(module))
    clear_moe_stats(module)
    total = loss + losses["moe_loss"]
    return {**output, "loss": total} if isinstance(output, dict) else total
