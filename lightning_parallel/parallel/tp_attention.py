"""Run an unchanged attention (or MLP) forward on the DTensor outputs of its sharded layers.

Why DTensors and not local shards: user code reshapes with the *global* head count
(``q.view(B, T, self.n_head, C // self.n_head)``). On a local shard that view fails; on a
DTensor sharded along the features the same view is legal and stays sharded along the heads,
so the code runs unchanged, and so does ``view(B, T, -1, hd)``, ``repeat_kv``, RoPE and
``F.scaled_dot_product_attention`` with or without ``is_causal``, ``attn_mask`` or
``enable_gqa``. Three things make that work (measured on torch 2.13, CPU, gloo):

* Plain tensors mixed with DTensors (RoPE ``cos``/``sin``, masks, a replicated norm weight):
  :class:`ReplicateMixedMode` wraps them as replicated DTensors *above* autograd, so the
  backward (which runs outside any context) sees DTensors too and a plain parameter gets
  its gradient reduced correctly (``implicit_replication`` alone fails in the backward).
* Tensors created inside a kernel decomposition (the causal mask of the math SDPA):
  ``implicit_replication``.
* On CPU the fused (flash) SDPA kernel has no DTensor sharding rule: the math kernel is
  forced inside the region (only there, only on CPU).

A region's outputs leave as plain tensors, so code outside the region (residual adds, the
user's loss) never meets a DTensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_parallel.parallel.errors import config_error


class ReplicateMixedMode(TorchFunctionMode):
    """Wrap plain tensors as replicated DTensors whenever a call also receives a DTensor."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
        if mesh is not None and any(type(a) is not DTensor and isinstance(a, Tensor) for a in flat):
            def wrap(a: Any) -> Any:
                if isinstance(a, Tensor) and not isinstance(a, DTensor):
                    return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
                return a

            args, kwargs = tree_map(wrap, (args, kwargs))
        return func(*args, **kwargs)


def _to_plain(value: Any) -> Any:
    """A region's DTensor outputs as ordinary tensors (full values), everything else as is."""
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        return value.full_tensor()
    return value


def gather_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """Local sequence shard -> the full sequence on every rank (backward: the rank's slice)."""
    return DTensor.from_local(x, mesh, [Shard(dim)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def slice_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """Full (replicated) sequence -> this rank's shard (backward: all-gather of the gradient)."""
    if x.shape[dim] % mesh.size():
        raise config_error(
            ValueError, "sequence length", x.shape[dim],
            f"with sequence_parallel=True it must be divisible by tensor_parallel_size={mesh.size()}",
            "pad or crop sequences to a multiple of the TP size, or set sequence_parallel=false",
        )
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)]).to_local()


def _first_tensor_arg(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor]) -> tuple[tuple, dict]:
    """Apply ``fn`` to the hidden states: the first positional tensor (else the first tensor kwarg)."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            return (*args[:i], fn(a), *args[i + 1 :]), kwargs
    for key, a in kwargs.items():
        if isinstance(a, Tensor):
            return args, {**kwargs, key: fn(a)}
    return args, kwargs


def _first_tensor_out(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (fn(out[0]), *out[1:])
    return out


class RegionForward:
    """Replaces a module's ``forward`` on the instance: same signature, run in the DTensor region.

    An object (not a closure) so that ``copy.deepcopy`` of the model rebinds it to the copy.
    ``gather_input`` / ``slice_output`` are the sequence-parallel boundary: the hidden states
    arrive split along the sequence and the attention needs all of it.
    """

    def __init__(
        self, module: nn.Module, mesh: DeviceMesh, *, dtensor_region: bool, gather_input: bool, slice_output: bool
    ) -> None:
        self.module = module
        self.original = module.forward
        self.mesh = mesh
        self.dtensor_region = dtensor_region
        self.gather_input = gather_input
        self.slice_output = slice_output
        self.force_math = mesh.device_type == "cpu"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gather_input:
            args, kwargs = _first_tensor_arg(args, kwargs, lambda x: gather_sequence(x, self.mesh))
        with contextlib.ExitStack() as stack:
            if self.dtensor_region:
                stack.enter_context(ReplicateMixedMode())
                stack.enter_context(implicit_replication())
                if self.force_math:
                    stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            out = self.original(*args, **kwargs)
        if self.dtensor_region:
            out = tree_map(_to_plain, out)
        if self.slice_output:
            out = _first_tensor_out(out, lambda y: slice_sequence(y, self.mesh))
        return out


def install_region(
    module: nn.Module, mesh: DeviceMesh, *, dtensor_region: bool, gather_input: bool = False, slice_output: bool = False
) -> None:
    """Route ``module``'s forward through :class:`RegionForward` (parameters and FQNs untouched)."""
    if isinstance(module.__dict__.get("forward"), RegionForward):
        raise config_error(
            RuntimeError, "apply_tensor_parallel", type(module).__name__,
            "this module is already tensor-parallel", "apply tensor parallelism once per model",
        )
    module.forward = RegionForward(  # type: ignore[method-assign]
        module, mesh, dtensor_region=dtensor_region, gather_input=gather_input, slice_output=slice_output
    )


def slice_output_hook(mesh: DeviceMesh) -> Callable[[nn.Module, Any, Any], Any]:
    """Forward hook for a replicated embedding under sequence parallelism: keep this rank's slice.

    The sequence dim of an embedding output is the one before the features: ``(B, T, C)`` for
    token ids, ``(T, C)`` for ``pos_emb(arange(T))``, so both still broadcast against each other.
    """

    def hook(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return slice_sequence(out, mesh, out.dim() - 2)

    return hook


def gather_input_hook(mesh: DeviceMesh) -> Callable[[nn.Module, Any], Any]:
    """Forward pre-hook for a replicated LM head under sequence parallelism: read the full sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return _first_tensor_arg(args, {}, lambda x: gather_sequence(x, mesh))[0]

    return hook


__all__ = [
    "RegionForward",
    "ReplicateMixedMode",
    "gather_input_hook",
    "gather_sequence",
    "install_region",
    "slice_output_hook",
    "slice_sequence",
]
