"""MoE layers inside pipeline stages (pp x ep): each MoE layer is one opaque op in the traced graph.

Why: a pipeline stage is cut from a ``torch.export`` trace, and MoE dispatch has data-dependent
shapes (how many tokens each expert receives, the all-to-all split sizes), which export cannot
capture. Yet nothing outside an MoE layer depends on those shapes: the layer maps ``[..., dim]``
to ``[..., dim]`` (an experts module: ``tokens [..., dim]`` to ``[..., dim]``). So while tracing,
each such *unit* (every :class:`~lightning_parallel.nn.MoE` layer whole, and every other experts
module, e.g. a Hugging Face one, that is not inside one) is replaced by a call of the op
``lightning_parallel::opaque_module(inputs, handle)``, whose shape rule is "the output looks like
the first input". At run time the op calls the unit itself, eagerly, with its own parameters:
routing, capacity dropping, expert parallelism's all-to-alls and the balance statistics all run
exactly as without pipelines, and the unit's autograd graph is the op output's graph (the op's
kernel sits on the ``Autograd`` dispatch key, so nothing is recomputed or re-derived).

What the trace cannot see, handled here and in the pipeline driver:

* **Ownership.** The unit's parameters are not graph inputs, so the stage module cut from the
  graph would not hold them; :func:`hold_unit_tensors` registers them in every stage that
  calls the unit, under their canonical names, so the pipeline's ownership (optimizer, release
  of other stages' tensors, checkpoints, clipping) counts them.
* **Balance losses.** A stage cannot return an extra loss to the last stage. Within
  :func:`moe_losses_to_backward`, each MoE call attaches its coefficient-weighted loss to its
  output with an identity whose backward adds the loss's gradient (Megatron-LM's approach):
  the gradient is what adding the loss to the microbatch loss would give. The loss of one
  microbatch is computed over that microbatch (with its statistics summed over the data-parallel
  ranks as usual), so a pipelined run equals a single-process run with gradient accumulation
  over the same microbatches, not one full-batch step: the balance loss is not linear in the
  batch. The detached values are recorded for logging.
* **Expert parallelism.** Applied after tracing (export rejects DTensor parameters), to the
  experts this rank's stages own: :func:`apply_stage_expert_parallel`.
* **Tensor-parallel stages** run their graph on DTensors; the op has no sharding rule, so there
  it is called through :func:`run_replicated`: the layer runs replicated over the tensor-parallel
  ranks on the full activations, and its parameters (:func:`unit_parameter_names`) stay whole.
* **ZeRO stages** (FSDP2) gather parameters into the stage's registrations, not into the layer
  the op calls, so the driver leaves the layer's parameters out of FSDP2 and averages their
  gradients itself.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.compat import FakeTensor
from lightning_parallel.nn.moe import MoE, MoEStats, clear_moe_stats, collect_moe_losses, named_moe_stats
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.experts.apply import apply_expert_parallel, find_expert_modules
from lightning_parallel.parallel.pipeline.tensor import replace_parameters, retarget_calls

_LIB = torch.library.Library("lightning_parallel", "DEF")
_LIB.define("opaque_module(Tensor[] inputs, int handle) -> Tensor")
_UNITS: dict[int, tuple[weakref.ReferenceType[nn.Module], str]] = {}  # handle -> (unit, its name)
_HANDLE_ATTR = "_lp_opaque_handle"
_next_handle = itertools.count()


@dataclass
class MoEStepRecord:
    """What the MoE calls in one :func:`moe_losses_to_backward` block measured (detached): balance
    losses, and per layer (by name) the statistics of each call."""

    scale: float
    aux: list[Tensor] = field(default_factory=list)
    z: list[Tensor] = field(default_factory=list)
    stats: dict[str, list[MoEStats]] = field(default_factory=dict)

    def layer_stats(self) -> dict[str, MoEStats]:
        """Per layer, the statistics of all its calls together: assignment counts add up over the
        microbatches (the global batch's counts), and the dropped fraction of equal microbatches
        is their mean."""
        out = {}
        for name, calls in self.stats.items():
            dropped = [c.dropped_fraction for c in calls if c.dropped_fraction is not None]
            out[name] = MoEStats(
                tokens_per_expert=torch.stack([c.tokens_per_expert for c in calls]).sum(0),
                dropped_fraction=torch.stack(dropped).mean() if dropped else None,
            )
        return out


_active: list[MoEStepRecord] = []


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``out``; its backward also sends a gradient of 1 into ``loss``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def _run_unit(inputs: list[Tensor], handle: int) -> Tensor:
    """The op's kernel: call the unit (under the trace's fake tensors, only the shape rule)."""
    if any(isinstance(x, FakeTensor) or x.is_meta for x in inputs):
        return torch.empty_like(inputs[0])
    ref, name = _UNITS[handle]
    unit = ref()
    if unit is None:
        raise RuntimeError(f"the module behind opaque op handle {handle} no longer exists (a stage outlived its model)")
    out = unit(*inputs)
    losses = collect_moe_losses(unit)
    measured = list(named_moe_stats(unit))
    clear_moe_stats(unit)  # their graph now lives in `out` (or nowhere): do not keep it twice
    record = _active[-1] if _active else None
    if record is None or not torch.is_grad_enabled() or not out.requires_grad:
        return out
    for sub, stats in measured:
        detached = MoEStats(stats.tokens_per_expert.detach(), dropped_fraction=_detached(stats.dropped_fraction))
        record.stats.setdefault(f"{name}.{sub}" if sub else name, []).append(detached)
    if losses:
        record.aux.append(losses["moe_aux_loss"].detach())
        record.z.append(losses["moe_z_loss"].detach())
        if losses["moe_loss"].requires_grad:
            out = _AddLossGradient.apply(out, losses["moe_loss"] * record.scale)
    return out


def _detached(value: Tensor | None) -> Tensor | None:
    return None if value is None else value.detach()


def run_replicated(inputs: list[Tensor], handle: int) -> Tensor:
    """The op in a tensor-parallel stage, whose graph runs on DTensors: the MoE layer is replicated
    over the tensor-parallel ranks (its parameters stay plain tensors), so it runs on the full
    inputs and its output rejoins the graph as a replicated DTensor. Both conversions are
    differentiable; the op itself never meets a DTensor (it has no sharding rule)."""
    mesh = next((x.device_mesh for x in inputs if isinstance(x, DTensor)), None)
    out = OPAQUE_OP([x.full_tensor() if isinstance(x, DTensor) else x for x in inputs], handle)
    if mesh is None:
        return out
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)


def replicate_opaque_calls(stage_module: nn.Module) -> int:
    """Route the opaque op calls of a tensor-parallel stage's graphs through :func:`run_replicated`;
    return how many calls were rewritten."""
    return retarget_calls(stage_module, {OPAQUE_OP: run_replicated})


def unit_parameter_names(module: nn.Module) -> set[str]:
    """Canonical names of the parameters inside opaque units (kept out of tensor parallelism in stages)."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    return {canonical[id(p)] for unit in opaque_units(module).values() for p in unit.parameters()}


def _shape_rule(inputs: list[Tensor], handle: int) -> Tensor:
    return torch.empty_like(inputs[0])


# Autograd key: the unit's own ops record the autograd graph; CompositeExplicitAutograd: the same
# call where autograd is off (inference mode skips the Autograd key).
_LIB.impl("opaque_module", _run_unit, "Autograd")
_LIB.impl("opaque_module", _run_unit, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_parallel::opaque_module", _shape_rule, lib=_LIB)
OPAQUE_OP = torch.ops.lightning_parallel.opaque_module.default


def opaque_units(module: nn.Module) -> dict[str, nn.Module]:
    """Modules a pipeline trace must keep opaque, by name: every ``MoE`` layer, and every experts
    module (:func:`~lightning_parallel.parallel.experts.apply.find_expert_modules`) outside one."""
    units = {name: sub for name, sub in module.named_modules() if isinstance(sub, MoE)}
    for name, sub in find_expert_modules(module).items():
        if not any(name.startswith(f"{u}.") for u in units):
            units[name] = sub
    return dict(sorted(units.items()))


def _handle(unit: nn.Module, name: str) -> int:
    """The unit's op handle (``name``: its name in the traced model, which its logged statistics use)."""
    handle = unit.__dict__.get(_HANDLE_ATTR)
    if handle is None or _UNITS[handle][0]() is not unit or _UNITS[handle][1] != name:
        handle = next(_next_handle)
        _UNITS[handle] = (weakref.ref(unit), name)
        unit.__dict__[_HANDLE_ATTR] = handle
    return handle


class _OpaqueForward:
    """A unit's ``forward`` while tracing: one op call on its tensor arguments."""

    def __init__(self, name: str, handle: int) -> None:
        self.name, self.handle = name, handle

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if kwargs or not args or not all(isinstance(a, Tensor) for a in args):
            raise config_error(
                TypeError, "module.forward", self.name,
                "a pipeline stage calls an MoE layer or experts module as one opaque op, which takes positional tensors only "
                f"(got {len(args)} positional, keywords {sorted(kwargs)})",
                "call it as layer(x) or experts(tokens, indices, weights)",
            )
        return OPAQUE_OP(list(args), self.handle)


def register_handles(module: nn.Module) -> None:
    """Give every unit of ``module`` its op handle now, in this process (a trace in a forked child,
    :mod:`~lightning_parallel.parallel.pipeline.fork_trace`, then uses these: its own registrations would be lost)."""
    for name, unit in opaque_units(module).items():
        _handle(unit, name)


@contextmanager
def opaque_forwards(module: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """While tracing: every unit of ``module`` is called through the opaque op; restored on exit."""
    units = opaque_units(module)
    previous = {name: unit.__dict__.get("forward") for name, unit in units.items()}
    try:
        for name, unit in units.items():
            unit.forward = _OpaqueForward(name, _handle(unit, name))  # type: ignore[method-assign]
        yield units
    finally:
        for name, unit in units.items():
            if previous[name] is None:
                unit.__dict__.pop("forward", None)
            else:
                unit.forward = previous[name]  # type: ignore[method-assign]


def _register_at(root: nn.Module, fqn: str, tensor: Tensor, kind: str) -> None:
    """Register ``tensor`` at ``fqn`` under ``root`` (``kind``: ``_parameters`` or ``_buffers``),
    creating empty container modules where the path does not exist yet."""
    *path, leaf = fqn.split(".")
    node = root
    for part in path:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node._modules[part] = child
        node = child
    getattr(node, kind)[leaf] = tensor


def hold_unit_tensors(stage_module: nn.Module, module: nn.Module) -> list[str]:
    """Register, in ``stage_module``, the parameters and buffers of every unit its graphs call.

    Returns the unit names. The tensors are ``module``'s own objects under their canonical names.
    """
    handles = set()
    for sub in stage_module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            handles.update(n.args[1] for n in graph.nodes if n.op == "call_function" and n.target is OPAQUE_OP)
    names = {id(m): n for n, m in module.named_modules()}
    held = []
    for handle in sorted(handles):
        unit = _UNITS[handle][0]()
        if unit is None or id(unit) not in names:
            raise RuntimeError(f"opaque op handle {handle} does not name a module of {type(module).__name__}")
        prefix = names[id(unit)]
        for kind, tensors in (("_parameters", unit.named_parameters()), ("_buffers", unit.named_buffers())):
            for name, tensor in tensors:
                _register_at(stage_module, f"{prefix}.{name}" if prefix else name, tensor, kind)
        held.append(prefix)
    return held


@contextmanager
def moe_losses_to_backward(scale: float) -> Iterator[MoEStepRecord]:
    """MoE calls under this block add ``scale`` x their balance loss to the backward (see the module
    docstring); ``scale`` is what the pipeline multiplies a microbatch's loss by (1 / microbatches)."""
    record = MoEStepRecord(scale)
    _active.append(record)
    try:
        yield record
    finally:
        _active.remove(record)


def apply_stage_expert_parallel(
    module: nn.Module, stage_modules: Iterable[nn.Module], owned: set[str], ep_mesh: DeviceMesh, dp_mesh: DeviceMesh
) -> dict[nn.Parameter, nn.Parameter]:
    """Shard the experts whose parameters this rank's stages own over ``ep_mesh``; old -> new parameter.

    The new parameters replace the old ones in ``module`` and in ``stage_modules``. The other
    experts were released (another stage keeps them) and stay as they are. MoE layers compute
    their statistics over ``dp_mesh``, as without pipelines.
    """
    mine = sorted(
        name for name, sub in find_expert_modules(module).items()
        if all(f"{name}.{p}" in owned for p, _ in sub.named_parameters(recurse=False))
    )
    if not mine:
        return {}
    before = dict(module.named_parameters())
    names = apply_expert_parallel(module, ep_mesh, dp_mesh, experts=mine)
    after = dict(module.named_parameters())
    mapping = {before[n]: after[n] for n in names}
    replace_parameters(stage_modules, {id(old): new for old, new in mapping.items()})
    return mapping


__all__ = [
    "MoEStepRecord",
    "OPAQUE_OP",
    "apply_stage_expert_parallel",
    "hold_unit_tensors",
    "moe_losses_to_backward",
    "opaque_forwards",
    "opaque_units",
]
