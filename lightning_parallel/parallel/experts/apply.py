"""Expert parallelism: shard experts over the ``ep`` axis and move tokens to them by all-to-all.

Layout. Expert ranks are data-parallel ranks (``ParallelDims`` splits ``dp`` into ``edp`` x
``ep``): every rank routes its own tokens, and only the experts' weights are split. Rank ``i``
of the ep group owns the contiguous block of experts ``[i * E/ep, (i + 1) * E/ep)`` and keeps
them under the original parameter names, as ``DTensor`` ``Shard(0)`` on the ep mesh (default,
so ``torch.distributed.checkpoint`` stores the global tensor) or as plain local tensors.

Dispatch, per experts module call ``experts(tokens, indices, weights)`` (the Hugging Face
convention; index ``num_experts`` = dropped): permute the rank's (token, choice) assignments
by expert, exchange per-expert counts (one small all-to-all), all-to-all the token rows with
uneven splits, run the module's own forward on the received rows with its local expert
weights, all-to-all the results back, weight them and sum them into their tokens. Every step is
differentiable; the backward runs the reverse all-to-alls.

Gradients: which reduction each parameter needs (the strategy does it, not this file):
* non-expert parameters (router, attention, shared expert, ...): average over ``dp``;
* expert parameters: average over ``edp`` only (the ranks holding the same expert block).
That rule is exact because the dispatcher scales the gradient reaching local expert weights by
``1/ep`` (``grad_scale``): an owner receives the summed gradient of its ep group's tokens, and
each rank's loss is a mean over its own tokens that data parallelism averages over ``dp``.
With ``edp == 1`` expert gradients need no reduction at all.

All validation (layout, divisibility) happens before the first collective.
"""

from __future__ import annotations

import math

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.nn.moe import MoE, MoEStats, set_moe_stats_group
from lightning_parallel.parallel.errors import config_error

ParamLayout = Literal["dtensor", "local"]
_STATE_ATTR = "_lp_expert_parallel"
_PLAN_PARAM_STYLES = ("grouped_gemm",)
_PLAN_MODULE_STYLES = ("moe_tp_experts",)


@dataclass
class AllToAllTraffic:
    """Rows and bytes this rank sent to *other* ranks by token all-to-alls (self-copies excluded),
    forward and backward, since the last ``reset``; for benchmarks and load analysis."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    calls: int = 0
    last_send_rows: list[int] = field(default_factory=list)  # dispatch split of the last call, per ep rank

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.calls = 0


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, me: int, traffic: AllToAllTraffic) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.me, ctx.traffic = send, recv, group, me, traffic
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        traffic.forward_bytes += _remote_bytes(x, send, me)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_in = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group)
        ctx.traffic.backward_bytes += _remote_bytes(grad, ctx.recv, ctx.me)
        return grad_in, None, None, None, None, None


def _remote_bytes(x: Tensor, splits: list[int], me: int) -> int:
    row = math.prod(x.shape[1:]) * x.element_size()  # from the shape: a rank may send no rows at all
    return (sum(splits) - splits[me]) * row


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (see "Gradients" above)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


# ----------------------------------------------------------------------------- discovery


def _leading_dim(name: str, module: nn.Module) -> int:
    """The expert count of an experts module: the shared leading dim of its direct parameters."""
    params = list(module.named_parameters(recurse=False))
    if not params:
        raise config_error(
            ValueError, "experts", name, "an experts module must hold its weights directly, with a leading num_experts dimension",
            "store experts as one tensor per weight of shape [num_experts, ...] (not an nn.ModuleList of MLPs)",
        )
    dims = {pname: p.shape[0] if p.dim() >= 1 else None for pname, p in params}
    if len(set(dims.values())) != 1 or None in dims.values():
        raise config_error(
            ValueError, "experts", name, f"all its parameters must share the leading num_experts dimension, found {dims}",
            "keep non-expert weights (router, shared expert) in another module",
        )
    count = next(iter(dims.values()))
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and declared != count:
        raise config_error(ValueError, "experts", name, f"num_experts={declared} but its weights have {count} experts", "make num_experts match the weights")
    for pname, p in params:
        if isinstance(p, DTensor):
            raise config_error(
                ValueError, "experts", f"{name}.{pname}", "it is already a DTensor (expert parallelism applied twice, or tensor parallelism on experts)",
                "apply expert parallelism once, and do not tensor-parallelise expert weights",
            )
    return int(count)


def _takes_three_args(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _plan_patterns(plan: object) -> list[re.Pattern[str]]:
    """Module-name patterns of experts modules declared in a Hugging Face ``base_model_ep_plan``."""
    if not isinstance(plan, dict):
        return []
    patterns = []
    for key, style in plan.items():
        if style in _PLAN_PARAM_STYLES:
            key = key.rsplit(".", 1)[0]
        elif style not in _PLAN_MODULE_STYLES:
            continue
        body = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split("."))
        patterns.append(re.compile(rf"(?:.*\.)?{body}"))
    return patterns


def find_expert_modules(module: nn.Module, experts: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Experts modules in ``module``, by fully qualified name.

    Found, in this order: the ``experts`` of every ``lightning_parallel.nn.MoE``; modules
    declared in a ``config.base_model_ep_plan`` (Hugging Face: ``"...experts.<w>": "grouped_gemm"``
    or ``"...experts": "moe_tp_experts"``, patterns relative to any module that carries the
    config); any module with an int ``num_experts`` attribute, direct parameters and a
    ``forward`` taking (tokens, indices, weights). ``experts`` (names) replaces the search.
    """
    named = dict(module.named_modules())
    if experts is not None:
        missing = [n for n in experts if n not in named]
        if missing:
            raise config_error(ValueError, "experts", missing, "no such submodules", "pass names from model.named_modules()")
        return {n: named[n] for n in experts}
    found: dict[str, nn.Module] = {}
    for name, sub in named.items():
        if isinstance(sub, MoE):
            found[f"{name}.experts" if name else "experts"] = sub.experts
    for holder_name, holder in named.items():
        patterns = _plan_patterns(getattr(getattr(holder, "config", None), "base_model_ep_plan", None))
        prefix = f"{holder_name}." if holder_name else ""
        for name, sub in named.items():
            rel = name[len(prefix) :] if name.startswith(prefix) else None
            if rel and any(p.fullmatch(rel) for p in patterns):
                found.setdefault(name, sub)
    owned = {id(m) for m in found.values()}
    for name, sub in named.items():
        if id(sub) in owned or isinstance(sub, MoE) or not isinstance(getattr(sub, "num_experts", None), int):
            continue
        params = list(sub.parameters(recurse=False))
        if params and all(p.dim() >= 2 and p.shape[0] == sub.num_experts for p in params) and _takes_three_args(sub):
            found[name] = sub
    return dict(sorted(found.items()))


def validate_expert_parallel(module: nn.Module, ep_size: int, experts: Sequence[str] | None = None) -> dict[str, int]:
    """Check that ``module`` can be expert-parallelised over ``ep_size`` ranks; no collectives.

    Returns ``{experts module name: num_experts}``. The strategy may call this before it builds
    any process group, so a bad configuration fails on every rank at once.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise config_error(ValueError, "expert_parallel_size", ep_size, "it must be an int >= 1", "use expert_parallel_size=2")
    modules = find_expert_modules(module, experts)
    if not modules:
        raise config_error(
            ValueError, "expert_parallel_size", ep_size,
            f"expert parallelism needs MoE layers, and {type(module).__name__} has none (no lightning_parallel.nn.MoE, "
            "no config.base_model_ep_plan, no experts module with num_experts and forward(tokens, indices, weights))",
            "use expert_parallel_size=1 for a dense model, or build the model with lightning_parallel.nn.MoE",
        )
    for name, sub in modules.items():
        if getattr(sub, _STATE_ATTR, None) is not None:
            raise config_error(RuntimeError, "experts", name, "it is already expert-parallel", "call apply_expert_parallel once per model")
    counts = {name: _leading_dim(name, sub) for name, sub in modules.items()}
    for name in modules:
        if counts[name] % ep_size:
            raise config_error(
                ValueError, "expert_parallel_size", ep_size,
                f"{name} has num_experts={counts[name]}, which must be divisible by the expert-parallel size",
                f"choose an expert_parallel_size that divides {counts[name]}",
            )
    return counts


# ----------------------------------------------------------------------------- dispatch


@contextmanager
def _local_weights(module: nn.Module, names: Sequence[str], scale: float, local_experts: int, patch_count: bool) -> Iterator[None]:
    """Run the module's own forward on its local expert block: its parameters are swapped for
    their local shards (gradient scaled), and an ``num_experts`` attribute reads the local count."""
    saved = {n: module._parameters[n] for n in names}
    saved_count = module.__dict__.get("num_experts")
    try:
        for n, p in saved.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            module._parameters[n] = _ScaleGrad.apply(local, scale)  # type: ignore[assignment]
        if patch_count:
            module.__dict__["num_experts"] = local_experts
        yield
    finally:
        module._parameters.update(saved)
        if patch_count:
            module.__dict__["num_experts"] = saved_count


class _ExpertParallelForward:
    """Replaces an experts module's ``forward`` (instance attribute: the class, its hooks and its
    parameter names stay); holds the ep group and the traffic counters."""

    def __init__(self, module: nn.Module, num_experts: int, ep_mesh: DeviceMesh, stats_group: dist.ProcessGroup, grad_scale: float, record_stats: bool) -> None:
        self.original_forward: Callable[..., Tensor] = module.forward
        self.module = module
        self.num_experts = num_experts
        self.group = ep_mesh.get_group()
        self.ep_size = ep_mesh.size()
        self.ep_rank = ep_mesh.get_local_rank()
        self.local_experts = num_experts // self.ep_size
        self.param_names = tuple(n for n, _ in module.named_parameters(recurse=False))
        self.stats_group = stats_group
        self.grad_scale = grad_scale
        self.record_stats = record_stats
        self.patch_count = module.__dict__.get("num_experts") == num_experts
        self.traffic = AllToAllTraffic()

    def __call__(self, tokens: Tensor, indices: Tensor, weights: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs:
            raise TypeError("an expert-parallel experts module takes exactly (tokens, indices, weights)")
        dim, top_k = tokens.shape[-1], indices.shape[-1]
        x = tokens.reshape(-1, dim)
        flat = indices.reshape(-1)
        valid = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
        experts_sorted, order = torch.sort(flat[valid], stable=True)
        assignment = valid[order]
        token = assignment // top_k
        counts = torch.bincount(experts_sorted, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [src, local expert] counts
        send = counts.view(self.ep_size, -1).sum(1).tolist()
        recv = received.view(self.ep_size, -1).sum(1).tolist()
        self.traffic.calls += 1
        self.traffic.last_send_rows = send
        rows = _AllToAll.apply(x[token], send, recv, self.group, self.ep_rank, self.traffic)
        local_ids = torch.arange(self.local_experts, device=flat.device).repeat(self.ep_size)
        local_index = torch.repeat_interleave(local_ids, received).unsqueeze(1)
        ones = torch.ones(local_index.shape, dtype=weights.dtype, device=weights.device)
        with _local_weights(self.module, self.param_names, self.grad_scale, self.local_experts, self.patch_count):
            h = self.original_forward(rows, local_index, ones)
        if rows.requires_grad:
            # An experts module given no rows may return a tensor that does not depend on them
            # (e.g. zeros); the backward would then skip the dispatch all-to-all on this rank
            # while its peers wait there for their tokens' gradients.
            h = h + 0.0 * rows.sum()
        back = _AllToAll.apply(h, recv, send, self.group, self.ep_rank, self.traffic)
        back = back * weights.reshape(-1)[assignment].unsqueeze(-1).to(back.dtype)
        out = torch.zeros_like(x).index_add(0, token, back.to(x.dtype))  # autocast: bf16 expert outputs, summed in x.dtype
        if self.record_stats:
            global_counts = counts.double()
            if dist.get_world_size(self.stats_group) > 1:
                dist.all_reduce(global_counts, group=self.stats_group)
            self.module.moe_stats = MoEStats(tokens_per_expert=global_counts.float())
        return out.reshape(tokens.shape)


# ----------------------------------------------------------------------------- public API


def apply_expert_parallel(
    module: nn.Module,
    ep_mesh: DeviceMesh,
    dp_mesh: DeviceMesh | None = None,
    *,
    experts: Sequence[str] | None = None,
    param_layout: ParamLayout = "dtensor",
    grad_scale: float | None = None,
) -> list[str]:
    """Shard every experts module in ``module`` over ``ep_mesh`` in place; return the names of
    the expert parameters (they need gradient averaging over ``edp`` only, see module docstring).

    ``dp_mesh`` is the full data-parallel axis: MoE layers compute their balance losses and
    statistics over it (global batch). Without it they use the ep group. All ranks must hold the
    same full expert weights before the call (same seed, or a broadcast), since each keeps its
    block without communicating. Create the optimizer afterwards.
    """
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        raise config_error(TypeError, "ep_mesh", ep_mesh, "it must be a 1D DeviceMesh", 'pass ParallelDims.axis("ep")')
    if dp_mesh is not None and (not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1):
        raise config_error(TypeError, "dp_mesh", dp_mesh, "it must be a 1D DeviceMesh or None", 'pass ParallelDims.axis("dp")')
    if param_layout not in ("dtensor", "local"):
        raise config_error(ValueError, "param_layout", param_layout, 'it must be "dtensor" or "local"', 'use param_layout="dtensor"')
    ep_size = ep_mesh.size()
    counts = validate_expert_parallel(module, ep_size, experts)
    modules = find_expert_modules(module, experts)
    rank = ep_mesh.get_local_rank()
    scale = 1.0 / ep_size if grad_scale is None else float(grad_scale)
    stats_group = (dp_mesh if dp_mesh is not None else ep_mesh).get_group()
    set_moe_stats_group(module, stats_group)
    ours = {id(m.experts) for m in module.modules() if isinstance(m, MoE)}
    names: list[str] = []
    for name, sub in modules.items():
        block = counts[name] // ep_size
        forward = _ExpertParallelForward(sub, counts[name], ep_mesh, stats_group, scale, record_stats=id(sub) not in ours)
        for pname, param in list(sub.named_parameters(recurse=False)):
            local = param.detach()[rank * block : (rank + 1) * block].clone()
            data = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False) if param_layout == "dtensor" else local
            sub.register_parameter(pname, nn.Parameter(data, requires_grad=param.requires_grad))
            names.append(f"{name}.{pname}" if name else pname)
        sub.forward = forward  # type: ignore[method-assign]
        setattr(sub, _STATE_ATTR, forward)
    return names


def expert_parameter_names(module: nn.Module) -> list[str]:
    """Names of the parameters sharded by ``apply_expert_parallel`` (for gradient reduction over
    ``edp``, DDP's ignore list, checkpoint and clipping code)."""
    names = []
    for mod_name, sub in module.named_modules():
        if getattr(sub, _STATE_ATTR, None) is not None:
            names += [f"{mod_name}.{n}" if mod_name else n for n, _ in sub.named_parameters(recurse=False)]
    return names


def all_to_all_traffic(module: nn.Module) -> dict[str, AllToAllTraffic]:
    """The traffic counters of every expert-parallel experts module, by name."""
    return {name: getattr(sub, _STATE_ATTR).traffic for name, sub in module.named_modules() if getattr(sub, _STATE_ATTR, None) is not None}


__all__ = [
    "AllToAllTraffic",
    "all_to_all_traffic",
    "apply_expert_parallel",
    "expert_parameter_names",
    "find_expert_modules",
    "validate_expert_parallel",
]
