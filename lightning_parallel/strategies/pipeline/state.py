"""The pipeline driver's state: full tensors gathered from the ranks that keep them, and checkpoints.

Why a separate piece: pipeline ranks free what their stages do not use, so every full view of
the model (a state dict for inspection, a consolidated or sharded checkpoint, a load into the
traced stages) is a question of which rank keeps which tensor, not of the schedule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.pipeline.tensor import full_value
from lightning_parallel.parallel.tensor.rank_order import carry
from lightning_parallel.strategies.checkpoint import pipeline as pckpt
from lightning_parallel.strategies.checkpoint.files import ZERO1_KEY, is_sharded_checkpoint, read_rest


class PipelineStateMixin:
    """Gathering, saving and loading for :class:`~lightning_parallel.strategies.pipeline.driver.PipelineDriver`."""

    # Set by the driver: the module, its pipeline group, and (once traced) the runtime and which
    # pipeline rank keeps each tensor; a checkpoint to read once the stages exist.
    module: Any
    group: Any
    device: torch.device
    runtime: Any
    _runtime: Any
    _keepers: dict[str, int]
    _pending_load: tuple[Path, bool, bool | None] | None

    # ------------------------------------------------------------------ full tensors
    def gather_state(self, parameters_only: bool = False) -> dict[str, Tensor]:
        """Every parameter (and buffer) as a full tensor on every pipeline rank, from the rank keeping it.

        A collective over the pipeline group. Why: ranks free what their stages do not use, so a
        full state dict (checkpoint, parity check) must come from the owners.
        """
        named = list(self.module.named_parameters())
        if not parameters_only:
            named += list(self.module.named_buffers())
        runtime = self._runtime
        out: dict[str, Tensor] = {}
        for name, tensor in named:
            if runtime is None or name not in self._keepers:
                out[name] = tensor.detach().clone()
                continue
            shape = runtime.released.get(name, tensor.shape)
            value = full_value(carry(tensor, tensor.detach())).clone() if name not in runtime.released else torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            dist.broadcast(value, src=dist.get_global_rank(self.group, self._keepers[name]), group=self.group)
            out[name] = value
        return out

    def model_state(self, full: bool = True) -> dict[str, Any]:
        """The LightningModule's state dict with every tensor full (gathered from its owner), on every rank.

        For inspection and tests (every rank receives every tensor): checkpoints use
        :meth:`checkpoint_model_state`, which never gathers whole parameters on every rank.
        """
        gathered = self.gather_state()
        by_id = {id(t): n for n, t in (*self.module.named_parameters(), *self.module.named_buffers())}
        state = self.module.state_dict(keep_vars=True)
        out = {}
        for key, value in state.items():
            tensor = gathered[by_id[id(value)]] if id(value) in by_id else value.detach()
            out[key] = tensor.cpu() if full else tensor
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_model_state(self, full: bool) -> dict[str, Any]:
        """The model state a checkpoint holds (see :mod:`lightning_parallel.strategies.checkpoint.pipeline`): with ``full``,
        consolidated on global rank 0 only; otherwise the tensors this rank keeps, as it holds them."""
        runtime = self._runtime
        if runtime is None and self._pending_load is not None:
            raise RuntimeError(
                f"Saving a checkpoint before the pipeline stages were traced, while the checkpoint {self._pending_load[0]}"
                " this run resumed from is still to be read (it is read into the stages at the first batch): the save"
                " would hold the module's initial weights. HINT: save after at least one training or evaluation batch."
            )
        if runtime is None:  # not traced yet: every rank holds the whole model (DCP writes one copy)
            return {k: v.detach().cpu() if full else v.detach() for k, v in self.module.state_dict(keep_vars=True).items()}
        if full:
            return pckpt.model_state_to_rank0(self.module, self._keepers, runtime.released, self.group, self.device)
        return pckpt.kept_model_state(self.module, self._keepers, dist.get_rank(self.group))

    def checkpoint_optimizer_state(self, optimizer: Any, full: bool) -> dict[str, Any]:
        """``optimizer``'s state as a checkpoint holds it: each entry from the rank keeping its parameter."""
        if self._runtime is None:  # not traced: every rank holds every state; pipeline rank 0 writes it
            return pckpt.kept_optimizer_state(self.module, optimizer, {}, dist.get_rank(self.group))
        if full:
            return pckpt.optimizer_state_to_rank0(self.module, optimizer, self._keepers, self.group, self.device)
        return pckpt.kept_optimizer_state(self.module, optimizer, self._keepers, dist.get_rank(self.group))

    def defer_load(self, path: Path, strict: bool, weights_only: bool | None = None) -> None:
        """Load ``path`` when the stages are traced (first batch): then each rank reads only the
        tensors its stages hold, and a meta-built model has real tensors to load into. The user's
        ``weights_only`` is kept for that read: the first batch is still the same load."""
        self._pending_load = (path, strict, weights_only)

    def load(self, path: Path, optimizers: list[Any], strict: bool, weights_only: bool | None = None) -> dict[str, Any] | None:
        """Load model (and ``optimizers``') state into the traced stages; each rank reads what it holds.
        Returns the rest of a consolidated file's checkpoint (``None`` for a sharded directory)."""
        runtime = self.runtime
        if is_sharded_checkpoint(path):
            # a ZeRO-1 run of an earlier version saved its optimizer state consolidated in meta.pt
            zero1 = read_rest(path, weights_only).get(ZERO1_KEY, {}) if optimizers else {}
            pckpt.load_held_sharded(self.module, optimizers, path, strict, runtime.released, zero1, weights_only)
            return None
        return pckpt.load_held_consolidated(self.module, optimizers, path, strict, runtime.released, self.device,
                                            weights_only)
