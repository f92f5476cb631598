"""Non-finite losses and gradients: one decision for every rank, taken before the optimizer steps.

Why: a NaN or Inf in one rank's gradients is a different failure under every layout. Under DDP
the all-reduce spreads it to every replica; under ZeRO-3 it lands in one shard only; under
tensor or pipeline parallelism it sits in the parameters of one rank's slice or stage, and the
other ranks step on, so the model silently diverges across ranks or, if one rank raises alone,
its peers hang in the next collective. The guard here makes every rank agree:

1. each rank checks its own loss and the local part of every gradient (``torch._foreach_norm``:
   one fused pass; a norm is finite exactly when every element is);
2. one ``all_reduce(MAX)`` of a flag over the world, on the device the group serves, so every
   rank sees the same verdict (no rank steps while another skips);
3. on a non-finite step:

   * ``"error"`` (default): every rank raises :class:`NonFiniteError` with the step number and the
     first parameter (in the module's parameter order, over all ranks) whose gradient is not
     finite, or says that the loss itself was not finite;
   * ``"skip"``: every rank drops the step's gradients (``grad = None``, so no optimizer touches
     the parameters or their state), warns, and raises after ``max_nonfinite_skips`` consecutive
     skipped steps (a model that keeps producing NaN is broken, not unlucky);
   * ``"off"``: no check, no collective (what Lightning's built-in strategies do).

The check runs after the closure (forward and backward) and before Lightning's clipping and
``on_before_optimizer_step``, as Lightning's own AMP plugin does with its grad scaler: clipping
an Inf gradient would turn every gradient into NaN and hide which parameter caused it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import foreach_norm
from lightning_parallel.errors import config_error

NonFiniteMode = Literal["error", "skip", "off"]
NONFINITE_MODES: tuple[str, ...] = ("error", "skip", "off")


class NonFiniteError(RuntimeError):
    """Raised on every rank together when a step's loss or gradients are not finite."""


def validate_nonfinite(mode: object, max_skips: object) -> None:
    """Typed errors for the two options, before any process starts."""
    if mode not in NONFINITE_MODES:
        raise config_error(ValueError, "on_nonfinite", mode, f"it must be one of {NONFINITE_MODES}",
                           "pass on_nonfinite='error' (fail at once), 'skip' (drop the step on every rank) or 'off'")
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1:
        raise config_error(ValueError if isinstance(max_skips, int) else TypeError, "max_nonfinite_skips", max_skips,
                           "it must be an int >= 1 (consecutive skipped steps before the run fails)",
                           "pass max_nonfinite_skips=3")


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _first_bad(named: list[tuple[str, nn.Parameter]], norms: list[Tensor]) -> int:
    """Index (in ``named``) of the first parameter whose local gradient norm is not finite, or -1."""
    for index, norm in enumerate(norms):
        if not bool(torch.isfinite(norm)):
            return index
    return -1


class NonFiniteGuard:
    """Holds the mode and the count of consecutive skipped steps (see the module doc)."""

    def __init__(self, mode: NonFiniteMode = "error", max_skips: int = 3) -> None:
        self.mode, self.max_skips = mode, max_skips
        self.consecutive_skips = 0
        self.total_skips = 0

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def step_is_finite(self, module: nn.Module, params: Iterable[nn.Parameter], loss: object, step: int,
                       device: torch.device) -> bool:
        """Check, agree over the world, then raise (``error``), drop the gradients and return
        False (``skip``), or return True for a finite step. Every rank calls it at every step."""
        params = list(params)
        with_grad = [p for p in params if p.grad is not None and _local(p.grad).numel() > 0]
        norms = foreach_norm([_local(p.grad) for p in with_grad]) if with_grad else []
        # The verdict stays a tensor until the one read after the all-reduce: one host-device sync per
        # step, not one per parameter (a per-norm ``bool()`` would stall a GPU ~100 times a step).
        flag = torch.zeros(1, device=device)
        if norms:
            flag = torch.logical_not(torch.isfinite(torch.stack([n.to(device) for n in norms]))).any().float().reshape(1)
        if isinstance(loss, Tensor) and loss.numel() > 0:
            flag = torch.maximum(flag, torch.logical_not(torch.isfinite(loss.detach())).any().float().to(device).reshape(1))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) == 0.0:
            self.consecutive_skips = 0
            return True
        # Failure path only: names, and which parameter (or the loss) it was
        names = {id(p): n for n, p in module.named_parameters()}
        index = {id(p): i for i, p in enumerate(params)}
        named = [(names.get(id(p), f"<parameter {index[id(p)]} of the optimizer>"), p) for p in with_grad]
        loss_bad = isinstance(loss, Tensor) and loss.numel() > 0 and not bool(torch.isfinite(loss.detach()).all())
        bad_index = _first_bad(named, norms)
        what = self._describe(module, named, bad_index, loss_bad)
        if self.mode == "error":
            raise NonFiniteError(
                f"step {step}: {what}. Every rank stops here together. HINT: lower the learning rate, enable"
                " gradient clipping (gradient_clip_val=...), check the data for NaN/Inf, or pass"
                " on_nonfinite='skip' to drop such steps on every rank"
            )
        for p in params:
            p.grad = None
        self.consecutive_skips += 1
        self.total_skips += 1
        if self.consecutive_skips >= self.max_skips:
            raise NonFiniteError(
                f"step {step}: {self.consecutive_skips} consecutive steps had non-finite values (last: {what});"
                f" max_nonfinite_skips={self.max_skips} reached. HINT: the model diverged: lower the learning rate,"
                " clip gradients, or check the data"
            )
        rank_zero_warn(f"Skipped step {step} on every rank: {what} ({self.consecutive_skips} in a row,"
                       f" {self.total_skips} in all)")
        return False

    @staticmethod
    def _describe(module: nn.Module, named: list[tuple[str, nn.Parameter]], bad_index: int, loss_bad: bool) -> str:
        """The first offending parameter over all ranks (parameter order of the module), or the loss."""
        order = {name: i for i, (name, _) in enumerate(module.named_parameters())}
        mine = None
        if bad_index >= 0:
            name = named[bad_index][0]
            mine = (order.get(name, len(order)), name)
        found: list[object] = [mine]
        if dist.is_available() and dist.is_initialized():  # failure path only: the names are strings
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, mine)
        hits = sorted(hit for hit in found if hit is not None)  # type: ignore[type-var]
        if hits:
            return f"the gradient of parameter '{hits[0][1]}' is not finite"  # type: ignore[index]
        return "the loss is not finite" if loss_bad else "a loss on another rank is not finite"
