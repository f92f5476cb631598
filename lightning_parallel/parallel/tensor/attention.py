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
* ``F.scaled_dot_product_attention`` on q/k/v split along the heads (the usual case, with or
  without ``is_causal``, a head-broadcast mask, or ``enable_gqa``) runs on the *local* shards
  with the default (fused) kernel: heads are independent, so each rank's heads need nothing
  from the others, and this skips both DTensor dispatch of the decomposed attention and the
  math kernel. The other cases (dropout in training, whose mask DTensor draws per global
  position; a per-head mask; other layouts) run on DTensors, and on CPU under the math kernel
  because the fused (flash) CPU kernel has no DTensor sharding rule.

A region's outputs leave as plain tensors, so code outside the region (residual adds, the
user's loss) never meets a DTensor, nor the ``AsyncCollectiveTensor`` that a row-parallel
output's (async) all-reduce or reduce-scatter returns: :func:`settled` waits for it inside the
region. Why that matters: under ``compile_blocks`` the region's output is an input of the
compiled rest of the block, and AOT autograd, which flattens a tensor-subclass input into its
inner tensor, sent that input's gradient past DTensor's ``to_local`` backward straight into the
all-reduce's backward, which needs a DTensor (measured, torch 2.13, ``aot_eager``:
``'Tensor' object has no attribute '_local_tensor'``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import AsyncCollectiveTensor, tree_flatten, tree_map
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.attention_weights import drop_unrequested_weights, head_split_probabilities, mark_probabilities
from lightning_parallel.parallel.tensor.flat_stream import stream_norm, stream_view
from lightning_parallel.parallel.tensor.fused import slice_packed, split_packed
from lightning_parallel.parallel.tensor.rank_order import full_natural, mark_linear_output, rank_order, rank_ordered_call
from lightning_parallel.parallel.tensor.merged_heads import local_baddbmm
from lightning_parallel.parallel.tensor.head_bias import derived_cut, head_cut, note_derived
from lightning_parallel.parallel.tensor.region_inputs import (
    gathered_stream,
    is_replicated,
    is_sequence_stream,
    replicated_region_input,
    ungathered,
)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _head_sharded(t: Any, mesh: DeviceMesh) -> bool:
    return (
        isinstance(t, DTensor) and t.ndim == 4 and t.device_mesh == mesh
        and len(t.placements) == 1 and t.placements[0] == Shard(1)
    )


def _local_mask(mask: Any, mesh: DeviceMesh, heads: int) -> Tensor | None | bool:
    """The mask for this rank's heads, or ``False`` if there is none such.

    A mask broadcast over the heads is used as is. A per-head one (T5's position bias, an ALiBi
    bias: ``(..., H, T, S)``) is cut to this rank's heads: taken as is when already split along
    them, else sliced from the replicated whole, whose gradient (if it needs one) is then gathered
    back in the backward, as DTensor's own rule for the full attention does: once for every layer
    reading the same bias (``head_bias``)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or (isinstance(mask, DTensor) and mask.device_mesh != mesh):
        return False
    if mask.ndim < 3 or mask.shape[-3] == 1:  # broadcast over the heads
        if isinstance(mask, DTensor):
            return mask.to_local() if is_replicated(mask) else False
        return mask
    head_dim = mask.ndim - 3
    if mask.shape[-3] != heads or heads % mesh.size():
        return False
    derived = derived_cut(mask, mesh, head_dim)  # (torch.where(padding, bias, min) of) a bias layers share
    if derived is not None:
        return derived
    if isinstance(mask, DTensor) and tuple(mask.placements) == (Shard(head_dim),):
        return mask.to_local()
    if not is_replicated(mask):
        return False
    return head_cut(mask, mesh, head_dim)


def local_sdpa(args: tuple, kwargs: dict) -> Tensor | None:
    """``F.scaled_dot_product_attention`` on this rank's heads, or ``None`` when not exactly that.

    q/k/v must be ``(B, H, T, hd)`` DTensors split along the heads on one mesh; grouped-query
    attention (``enable_gqa`` or ``H_kv < H``) stays exact because rank ``r``'s query heads map
    to rank ``r``'s key/value heads (both are contiguous blocks of the same group size). A mask
    is broadcast over the heads or cut to this rank's (:func:`_local_mask`).
    """
    if len(args) > len(_SDPA_ARGS) or set(kwargs) - set(_SDPA_ARGS):
        return None
    bound = dict(zip(_SDPA_ARGS, args), **kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not isinstance(q, DTensor):
        return None
    mesh = q.device_mesh
    if not (_head_sharded(q, mesh) and _head_sharded(k, mesh) and _head_sharded(v, mesh)):
        return None
    if bound.get("dropout_p", 0.0):
        return None  # DTensor's RNG gives each global position its own draw; local draws would repeat per rank
    mask = _local_mask(bound.get("attn_mask"), mesh, q.shape[1])
    if mask is False:
        return None
    extra = {name: bound[name] for name in ("scale", "enable_gqa") if name in bound}
    out = F.scaled_dot_product_attention(
        q.to_local(), k.to_local(), v.to_local(), attn_mask=mask, is_causal=bool(bound.get("is_causal", False)), **extra
    )
    return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


_CAT = frozenset({torch.cat, torch.concat, torch.concatenate})


def _without_legacy_empty(tensors: list | tuple) -> list | tuple:
    """``torch.cat`` skips 1-D empty plain tensors (its legacy rule); DTensor's ``cat`` does not.

    Hugging Face's ``DynamicCache`` (on by default, ``use_cache=True``, also in training) starts
    each layer with ``torch.tensor([])`` and concatenates the new keys/values to it along dim -2:
    with DTensor keys the empty tensor became a replicated 1-D DTensor and the cat failed with
    "Dimension out of range". Dropping exactly what ``torch.cat`` ignores keeps its semantics.
    """
    if not any(isinstance(t, DTensor) for t in tensors):
        return tensors
    kept = [t for t in tensors if isinstance(t, DTensor) or not (isinstance(t, Tensor) and t.ndim == 1 and t.numel() == 0)]
    return kept if len(kept) != len(tensors) else tensors


class ReplicateMixedMode(TorchFunctionMode):
    """Wrap plain tensors as replicated DTensors whenever a call also receives a DTensor.

    Attention on head-split DTensors goes to :func:`local_sdpa`; when that does not apply it runs
    on DTensors, under the math kernel on CPU (no DTensor rule for the fused CPU kernel).
    """

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Phi-3's [q | k | v] of unequal parts, stored in rank order: its cuts from the shard, else whole.
        ordered, args, kwargs = rank_ordered_call(func, args, kwargs, self._wrapped)
        if ordered is not None:
            return ordered
        args = ungathered(func, args)  # a residual add of a region's gathered input keeps the split stream
        flat = stream_view(func, args, kwargs)  # a stack's stream flattened to tokens, or back: local
        if flat is None:
            flat = stream_norm(func, args, kwargs, self._wrapped)
        if flat is not None:
            return flat
        if func in _CAT and args and isinstance(args[0], (list, tuple)):
            args = (_without_legacy_empty(args[0]), *args[1:])
        pieces = split_packed(func, args, kwargs)  # [q | k | v] of a packed projection: its parts, still split
        if pieces is not None:
            return pieces
        piece = slice_packed(func, args, kwargs)  # one part of it, cut by a slice
        if piece is not None:
            return piece
        scores = local_baddbmm(func, args, kwargs)  # heads merged into the batch dim (Bloom's ALiBi scores)
        if scores is not None:
            return scores
        if func is F.scaled_dot_product_attention:
            out = local_sdpa(args, kwargs)
            if out is not None:
                return out
            query = args[0] if args else kwargs.get("query")
            if isinstance(query, DTensor) and query.device.type == "cpu":
                with sdpa_kernel(SDPBackend.MATH):
                    return self._wrapped(func, args, kwargs)
        return self._wrapped(func, args, kwargs)

    @classmethod
    def _wrapped(cls, func: Callable, args: tuple, kwargs: dict) -> Any:
        out = mark_linear_output(func, args, kwargs, cls._call(func, args, kwargs))
        mark_probabilities(func, args, out)  # attention weights: gathered only if the model returns them
        note_derived(func, args, kwargs, out)  # a mask made from a per-head bias: cut from the bias's one cut
        return out

    @staticmethod
    def _call(func: Callable, args: tuple, kwargs: dict) -> Any:
        # Fast path (most calls of a region: every tensor argument a DTensor, or none is): a flat
        # scan instead of two pytree passes, which cost as much as the DTensor dispatch of a view.
        dtensors = plain = nested = False
        for a in (*args, *kwargs.values()):
            if isinstance(a, DTensor):
                dtensors = True
            elif isinstance(a, Tensor):
                plain = True
            elif isinstance(a, (list, tuple, dict)):
                nested = True
        if not nested and not (dtensors and plain):
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
        if mesh is not None and any(type(a) is not DTensor and isinstance(a, Tensor) for a in flat):
            def wrap(a: Any) -> Any:
                if isinstance(a, Tensor) and not isinstance(a, DTensor):
                    return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
                return a

            args, kwargs = tree_map(wrap, (args, kwargs))
        return func(*args, **kwargs)


def full_value(value: Any) -> Any:
    """A DTensor as the plain full tensor it stands for (differentiably), everything else as is:
    a region's outputs, a tensor-parallel pipeline stage's outputs."""
    if isinstance(value, DTensor):
        if rank_order(value) is not None:  # stored in rank order (Phi-3's qkv_proj): in the model's order
            return full_natural(value)
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        return value.full_tensor()
    return value


class _Settle(torch.autograd.Function):
    """``AsyncCollectiveTensor`` -> a plain tensor with its value, waited for; the gradient as is."""

    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:  # type: ignore[override]
        # A copy, not the waited tensor or a view of it: the caller may update the region's output in
        # place (Falcon adds into its attention output), which autograd forbids on a view made in a
        # custom Function, and autograd writes its metadata into the output (the waited tensor is the
        # collective's buffer). One activation-sized copy per region output, freed with the buffer.
        return value.wait().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def settled(value: Any) -> Any:
    """A pending collective's result as a plain tensor (differentiably), everything else as is.

    In eager mode this moves the wait from the value's first use to here: nothing for a region's
    output (its first use, the residual add, comes next); on CUDA the wait orders the compute
    stream after the collective's and does not block the host.
    """
    return _Settle.apply(value) if isinstance(value, AsyncCollectiveTensor) else value


def settle_output_hook(module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a tensor-parallel module outside a region (the vocabulary-parallel embedding,
    the LM head): its pending all-reduce / all-gather as a plain tensor, as :func:`settled` says why
    (a Llama's embedding output is the first compiled decoder layer's input)."""
    return tree_map(settled, out)


def gather_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """Local sequence shard -> the full sequence on every rank (backward: the rank's slice)."""
    return DTensor.from_local(x, mesh, [Shard(dim)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def to_stream(value: Any) -> Any:
    """A region's hidden-state output under sequence parallelism split along the sequence: a
    row-parallel ``Partial`` sum reduce-scattered, a ``Shard(1)`` one as it is; a plain one as is."""
    if isinstance(value, DTensor):
        return value.redistribute(value.device_mesh, [Shard(1)] * value.device_mesh.ndim)
    return value


def sequence_slice(value: Tensor) -> Tensor:
    """:func:`to_stream` as this rank's plain slice of the sequence."""
    value = to_stream(value)
    return value.to_local() if isinstance(value, DTensor) else value


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


class _Depth(threading.local):
    value = 0


_REGION_DEPTH = _Depth()  # regions running on this thread: a region called inside another is part of it


def _later_outputs(out: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every output but the first (the hidden states)."""
    if isinstance(out, tuple) and out:
        return (out[0], *tree_map(fn, out[1:]))
    return out


class RegionForward:
    """Replaces a module's ``forward`` on the instance: same signature, run in the DTensor region.

    An object (not a closure) so that ``copy.deepcopy`` of the model rebinds it to the copy.
    ``gather_input`` / ``slice_output`` are the sequence-parallel boundary: the hidden states
    arrive split along the sequence and the attention needs all of it.
    """

    def __init__(
        self, module: nn.Module, mesh: DeviceMesh, *, dtensor_region: bool, gather_input: bool, slice_output: bool,
        keep_heads: bool = False,
    ) -> None:
        self.module = module
        self.original = module.forward
        self.mesh = mesh
        self.dtensor_region = dtensor_region
        self.gather_input = gather_input
        self.slice_output = slice_output
        self.keep_heads = keep_heads  # holds a per-head embedding (``embedding_colwise``): see :meth:`_leaving`

    def _leaving(self, out: Any, passed: set[int]) -> Callable[[Any], Any]:
        """How each output leaves: full, except a later output that is one of the caller's own DTensors
        (it leaves as it came) or, with ``keep_heads``, a bias split along the heads (T5's position bias
        from its split embedding: every later region reads it on its own heads, and nothing between
        them computes with it). Attention probabilities a caller asked for leave full."""
        later = out[1:] if isinstance(out, tuple) else ()
        kept = {id(v) for v in later if isinstance(v, DTensor) and (id(v) in passed or (
            self.keep_heads and v.ndim == 4 and tuple(v.placements) == (Shard(1),) and not head_split_probabilities(v)))}
        return lambda v: v if id(v) in kept else full_value(v)

    def _region_input(self, x: Tensor) -> Tensor:
        """The hidden states as ONE replicated DTensor for the whole region (sequence gathered first
        under sequence parallelism).

        Why: a column-parallel layer turns a plain input into a DTensor of its own, and that
        conversion's backward reduces the layer's partial input gradient by itself, so q, k and v
        (or gate and up) reading the same hidden states sent one all-reduce each. With a single
        DTensor entering the region, autograd sums the layers' partial gradients (still ``Partial``)
        and the one conversion here reduces them once: an all-reduce, or under sequence parallelism
        a reduce-scatter back to this rank's slice (the Megatron minimum).
        """
        if is_sequence_stream(x):  # gathered once here (q, k and v would each gather it)
            return gathered_stream(x)
        if isinstance(x, DTensor) or not x.is_floating_point():
            return gather_sequence(x, self.mesh) if self.gather_input and not isinstance(x, DTensor) else x
        if self.gather_input:
            return DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False).redistribute(self.mesh, [Replicate()])
        return replicated_region_input(x, self.mesh)  # shared with any other region reading x

    def _region_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The hidden states through :meth:`_region_input`; every other top-level floating input that
        needs a gradient (cross-attention's encoder output, read by its key and value projections; a
        learned position bias) as one replicated DTensor too, for the same reason: its readers'
        partial gradients summed before one all-reduce, not one each (T5 and BART sent one per
        key and value projection). Under sequence parallelism only the hidden states are split."""
        converted: dict[int, Tensor] = {}

        def first(x: Tensor) -> Tensor:
            converted[id(x)] = self._region_input(x)
            return converted[id(x)]

        args, kwargs = _first_tensor_arg(args, kwargs, first)
        if self.gather_input:
            return args, kwargs

        def other(a: Any) -> Any:
            if not isinstance(a, Tensor) or isinstance(a, DTensor) or not (a.is_floating_point() and a.requires_grad):
                return a
            if id(a) not in converted:
                converted[id(a)] = replicated_region_input(a, self.mesh)
            return converted[id(a)]

        return tuple(other(a) for a in args), {k: other(v) for k, v in kwargs.items()}

    # Eager even inside a compiled block (``compile_blocks``): the region's dispatch mode and
    # implicit replication are not traceable by dynamo, so the block's graph breaks around it.
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _REGION_DEPTH.value:  # inside another region (BERT's attention in its layer): part of it
            return self.original(*args, **kwargs)
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        stream = is_sequence_stream(hidden)  # under sequence parallelism over block stacks (``sequence_stacks``)
        _REGION_DEPTH.value += 1
        try:
            out = self._run(args, kwargs, stream)
        finally:
            _REGION_DEPTH.value -= 1
        if stream and self.dtensor_region:  # stays the stack's split stream: a reduce-scatter of the partial sums
            return _first_tensor_out(out, to_stream)
        return out

    def _run(self, args: tuple, kwargs: dict, stream: bool) -> Any:
        passed = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, DTensor)}
        if self.dtensor_region:
            args, kwargs = self._region_inputs(args, kwargs)
        elif self.gather_input:
            args, kwargs = _first_tensor_arg(args, kwargs, lambda x: gather_sequence(x, self.mesh))
        with contextlib.ExitStack() as stack:
            if self.dtensor_region:
                stack.enter_context(ReplicateMixedMode())
                stack.enter_context(implicit_replication())
            out = self.original(*args, **kwargs)
        if self.dtensor_region:  # head-split attention weights nobody asked for are not gathered
            out = drop_unrequested_weights(out)
            if self.gather_input:  # the hidden states leave as this rank's slice of the sequence
                out = _first_tensor_out(out, sequence_slice)
            leave = self._leaving(out, passed)
            out = _later_outputs(out, leave) if stream else tree_map(leave, out)
        if self.slice_output:
            out = _first_tensor_out(out, lambda y: slice_sequence(y, self.mesh))
        return tree_map(settled, out)


def install_region(
    module: nn.Module, mesh: DeviceMesh, *, dtensor_region: bool, gather_input: bool = False, slice_output: bool = False,
    keep_heads: bool = False,
) -> None:
    """Route ``module``'s forward through :class:`RegionForward` (parameters and FQNs untouched)."""
    if isinstance(module.__dict__.get("forward"), RegionForward):
        raise config_error(
            RuntimeError, "apply_tensor_parallel", type(module).__name__,
            "this module is already tensor-parallel", "apply tensor parallelism once per model",
        )
    module.forward = RegionForward(  # type: ignore[method-assign]
        module, mesh, dtensor_region=dtensor_region, gather_input=gather_input, slice_output=slice_output,
        keep_heads=keep_heads,
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
    "full_value",
    "ReplicateMixedMode",
    "gather_input_hook",
    "gather_sequence",
    "install_region",
    "local_sdpa",
    "settle_output_hook",
    "settled",
    "slice_output_hook",
    "slice_sequence",
]
