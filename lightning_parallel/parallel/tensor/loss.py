"""Loss parallelism: cross-entropy on vocabulary-sharded logits, for an unchanged training step.

Why: with a column-parallel LM head the logits ``(B, T, V)`` are gathered on every rank before
the user's ``F.cross_entropy``, and the loss's backward keeps a full ``(B*T, V)`` log-softmax.
For a large vocabulary that is the biggest activation of the model. ``torch``'s
``loss_parallel`` computes the same cross-entropy on the ``V / tp`` shards with three small
all-reduces (max, sum of exponentials, target logit), so nothing of size ``V`` is gathered.

The difficulty is the *unchanged* step: ``loss_parallel`` needs a ``Shard(class dim)`` DTensor
and the call (and its backward) inside its context, while the user's ``training_step`` was
written for a plain tensor. What this module does, during a step (:func:`sharded_logits_step`):

* The LM head (parallelised with a ``Shard(-1)`` DTensor output, see ``tensor_parallel``) hands
  the step its DTensor, marked as "sharded logits" (:func:`head_output_hook`). Outside a step
  (``predict_step``, a plain ``model(x)``) the same hook gathers, as without loss parallelism.
* A ``TorchFunctionMode`` watches every call that receives marked logits:

  - reshapes, views, basic slices, ``detach``, dtype casts and metadata (``size()``, ``shape``,
    ``ndim``, ...) run on the DTensor: global shapes, so ``logits.view(-1, V)`` with the
    global ``V`` stays correct, and the result stays marked while it is still sharded;
  - ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) with class-index targets, on logits
    sharded along the class dim, runs under ``loss_parallel`` in forward *and* backward (a
    small autograd function re-enters the context, so Lightning's closure, ``manual_backward``
    and precision plugins need nothing special) and returns an ordinary tensor;
  - ``argmax`` / ``max(dim)`` over the vocabulary (accuracy metrics) run on the shards: each
    rank's first maximum and its global index are all-gathered (2 numbers per row) and the
    first global maximum wins, which is exactly ``torch.argmax``'s tie rule;
  - anything else (``softmax``, ``log_softmax``, ``topk``, label smoothing, probability
    targets, indexing with tensors, a torchmetrics update on the logits, ``print``) first gathers the full logits
    (a differentiable all-gather) and runs on plain tensors. That is always correct, but it
    does not save the memory of the full logits, so rank 0 warns once per operation.

* Whatever the step returns is released: marked logits inside the output (``{"loss": ...,
  "logits": logits}``) leave as full plain tensors.

Limits (no silent wrong results, but no memory saving either): logits stored outside the step
(``self.last_logits = logits``) stay DTensors there; only the head named in the plan's
``lm_heads`` is sharded (a model computing its loss from another projection gathers as before).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import compute_local_shape_and_global_offset, tree_map

_MARK = "_lightning_parallel_sharded_logits"
_active_steps = 0  # steps running inside sharded_logits_step (the LM head hook reads it)
_paused = 0  # >0 while release() converts outputs: its own DTensor calls must pass through
_warned: set[str] = set()

# Calls that keep the logits sharded: they run on the DTensor (global shapes) and their result
# stays marked while it is still sharded along one dim. Property getters (``shape``, ``dtype``,
# ``.T`` ...) arrive as ``__get__`` and are treated the same way.
_LAYOUT_OPS: frozenset[Callable[..., Any]] = frozenset({
    Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten, Tensor.contiguous,
    Tensor.detach, torch.detach, Tensor.transpose, torch.transpose, Tensor.permute, torch.permute,
    Tensor.__getitem__, Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type_as,
    Tensor.size, Tensor.dim, Tensor.numel, torch.numel, Tensor.__len__, Tensor.is_floating_point,
    torch.is_floating_point, Tensor.element_size, Tensor.requires_grad_,
})
_CROSS_ENTROPY: frozenset[Callable[..., Any]] = frozenset({F.cross_entropy})
_ARGMAX: frozenset[Callable[..., Any]] = frozenset({Tensor.argmax, torch.argmax})
_MAX: frozenset[Callable[..., Any]] = frozenset({Tensor.max, torch.max})
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def _is_marked(value: Any) -> bool:
    return isinstance(value, DTensor) and bool(getattr(value, _MARK, False))


def _mark(value: DTensor) -> DTensor:
    setattr(value, _MARK, True)
    return value


def _any_marked(args: tuple, kwargs: dict) -> bool:
    """Shallow scan (arguments and one level of lists): this runs for every op of the step."""
    for value in (*args, *kwargs.values()):
        if _is_marked(value):
            return True
        if isinstance(value, (list, tuple)) and any(_is_marked(v) for v in value):
            return True
    return False


def _single_shard_dim(x: DTensor) -> int | None:
    """The tensor dim ``x`` is split along, if it is split along exactly one (1-D mesh)."""
    if len(x.placements) == 1 and isinstance(x.placements[0], Shard):
        return x.placements[0].dim % x.ndim
    return None


def _settle(value: Any) -> Any:
    """After a layout op: still sharded -> stays marked; replicated -> plain; else gathered."""
    if not isinstance(value, DTensor):
        return value
    if _single_shard_dim(value) is not None:
        return _mark(value)
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()
    return value.full_tensor()


def _gather(value: Any) -> Any:
    return value.full_tensor() if _is_marked(value) else value


def _warn_gather(func: Callable[..., Any]) -> None:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if name in _warned:
        return
    _warned.add(name)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(
            f"loss_parallel: `{name}` on the vocabulary-sharded logits gathers the full logits first (correct, but "
            "that call gets no memory saving). Only F.cross_entropy with class-index targets, argmax/max over the "
            "vocabulary, reshapes and views keep them sharded. HINT: compute softmax-based metrics from "
            "detached logits in validation only, or set loss_parallel=False",
            stacklevel=3,
        )


@contextlib.contextmanager
def _loss_ops() -> Generator[None, None, None]:
    """``loss_parallel()``, with its custom DTensor ops removed even if the body raises."""
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


class _ShardedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` on class-sharded logits; forward and backward under ``loss_parallel``.

    The inner graph (built in forward) is differentiated in backward inside the context again,
    because the backward of the parallel log-softmax is only correct with the custom handlers.
    Returns the loss as a plain tensor (its replicated value), so the step sees no DTensor.

    Class weights are applied here, on the unweighted per-target losses: torch's parallel
    backward indexes the weights with the raw targets, so an ``ignore_index`` target in a
    weighted loss fails there (torch 2.13, ``_nll_loss_and_log_softmax_backward``).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: DTensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str
    ) -> Tensor:
        with torch.enable_grad():
            inner = logits.detach().requires_grad_(logits.requires_grad)
            with _loss_ops():
                if weight is None:
                    loss = F.cross_entropy(inner, target, ignore_index=ignore_index, reduction=reduction).to_local()
                else:
                    per_target = F.cross_entropy(inner, target, ignore_index=ignore_index, reduction="none").to_local()
                    kept = target != ignore_index
                    w = weight[torch.where(kept, target, 0)] * kept
                    loss = per_target * w
                    if reduction != "none":
                        loss = loss.sum() if reduction == "sum" else loss.sum() / w.sum()
        ctx.inner, ctx.loss = (inner, loss) if logits.requires_grad else (None, None)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:  # type: ignore[override]
        with _loss_ops():
            (grad_logits,) = torch.autograd.grad(ctx.loss, ctx.inner, grad)
        ctx.inner = ctx.loss = None
        return grad_logits, None, None, None, None


def _sharded_cross_entropy(args: tuple, kwargs: dict) -> Tensor | None:
    """The sharded loss when ``loss_parallel`` supports the call exactly, else ``None``."""
    try:
        bound = _CE_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    logits, target, weight = a["input"], a["target"], a["weight"]
    if not _is_marked(logits) or _single_shard_dim(logits) != (1 if logits.ndim >= 2 else 0):
        return None
    if not isinstance(target, Tensor) or isinstance(target, DTensor) or target.is_floating_point():
        return None  # probability targets: not supported by loss_parallel
    if weight is not None and (not isinstance(weight, Tensor) or isinstance(weight, DTensor)):
        return None
    if a["size_average"] is not None or a["reduce"] is not None or a["label_smoothing"] != 0.0:
        return None
    if a["reduction"] not in ("mean", "sum", "none"):
        return None
    return _ShardedCrossEntropy.apply(logits, target, weight, int(a["ignore_index"]), a["reduction"])


def _argmax_parts(x: DTensor, dim: int) -> tuple[Tensor, Tensor]:
    """Per row over the sharded ``dim``: the global max value and its first global index."""
    local = x.to_local().detach()
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    index = local.argmax(dim, keepdim=True)
    pair = torch.cat([local.gather(dim, index).double(), (index + offset[dim]).double()], dim=dim)
    # all-gather both numbers of every rank: (..., 2 * tp, ...) along dim, ranks in offset order
    pairs = DTensor.from_local(pair, x.device_mesh, [Shard(dim)], run_check=False).full_tensor()
    values, indices = pairs.unflatten(dim, (-1, 2)).unbind(dim + 1)
    winner = values.argmax(dim, keepdim=True)  # first rank holding the maximum = lowest global index
    return values.gather(dim, winner).to(x.dtype), indices.gather(dim, winner).long()


def _dim_arg(args: tuple, kwargs: dict) -> tuple[Any, bool]:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    return dim, keepdim


def _sharded_argmax(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``argmax``/``max(dim)`` over the sharded dim without gathering; ``None`` if not that case."""
    x = args[0] if args else kwargs.get("input")
    dim, keepdim = _dim_arg(args, kwargs)
    if not _is_marked(x) or not isinstance(dim, int) or isinstance(dim, bool) or set(kwargs) - {"dim", "keepdim", "input"}:
        return None
    if _single_shard_dim(x) != dim % x.ndim:
        return None
    if func in _MAX and x.requires_grad and torch.is_grad_enabled():
        return None  # the max values would need a gradient routed to the owning shard
    values, indices = _argmax_parts(x, dim % x.ndim)
    if not keepdim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    if func in _ARGMAX:
        return indices
    return torch.return_types.max((values, indices))


def _tensor_index(func: Callable[..., Any], args: tuple) -> bool:
    """``logits[mask]`` / ``logits[rows, cols]``: advanced indexing mixes in plain tensors, so gather."""
    if func is not Tensor.__getitem__ or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, (Tensor, list)) for i in index)


class ShardedLogitsMode(TorchFunctionMode):
    """Routes the calls that receive marked (vocabulary-sharded) logits; see the module doc."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _paused or not _any_marked(args, kwargs):
            return func(*args, **kwargs)
        if (func in _LAYOUT_OPS or getattr(func, "__name__", "") == "__get__") and not _tensor_index(func, args):
            out = func(*args, **kwargs)
            return _settle(out) if isinstance(out, Tensor) else out
        if func in _CROSS_ENTROPY:
            loss = _sharded_cross_entropy(args, kwargs)
            if loss is not None:
                return loss
        elif func in _ARGMAX or func in _MAX:
            result = _sharded_argmax(func, args, kwargs)
            if result is not None:
                return result
        _warn_gather(func)
        args, kwargs = tree_map(_gather, (args, kwargs))
        return func(*args, **kwargs)


def release(output: Any) -> Any:
    """Marked logits in a step's output (``{"loss": l, "logits": logits}``) as full plain tensors."""
    global _paused
    _paused += 1
    try:
        return tree_map(_gather, output)
    finally:
        _paused -= 1


@contextlib.contextmanager
def sharded_logits_step(enabled: bool) -> Generator[Callable[[Any], Any], None, None]:
    """Scope of one step in which the LM head's logits stay sharded; yields :func:`release`.

    Disabled (``loss_parallel=False``), it costs nothing and yields the identity.
    """
    global _active_steps
    if not enabled:
        yield lambda output: output
        return
    _active_steps += 1
    try:
        with ShardedLogitsMode():
            yield release
    finally:
        _active_steps -= 1


def head_output_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a ``Shard(-1)``-output LM head: keep it sharded in a step, else gather."""
    if not isinstance(output, DTensor):
        return output
    if _active_steps:
        return _mark(output)
    return output.full_tensor()


def install_sharded_head(module: nn.Module, heads: list[str]) -> None:
    """Hook every head named in ``heads`` (already column-parallel with a DTensor output)."""
    for name in heads:
        module.get_submodule(name).register_forward_hook(head_output_hook)


__all__ = ["ShardedLogitsMode", "head_output_hook", "install_sharded_head", "release", "sharded_logits_step"]
