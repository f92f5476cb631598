"""Checkpoints keyed by the original parameter names, whatever the layout.

Model and optimizer states go through ``torch.distributed.checkpoint`` (DCP): its state-dict
API returns parameters under their original FQNs (DTensor shards under sharding, full tensors
otherwise), so a checkpoint written under one layout loads under another. Two formats:

* sharded (default): a directory; each rank writes its own shards with ``dcp.save`` and rank 0
  writes the rest of Lightning's checkpoint (loops, callbacks, schedulers) to ``meta.pt``;
* full: one ``torch.save`` file on rank 0 holding consolidated tensors, loadable anywhere.

ZeRO-1's ``ZeroRedundancyOptimizer`` is not understood by DCP's optimizer API; its state is
consolidated on rank 0 and stored, keyed by FQN like every other optimizer state, in the
non-DCP part of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_parallel.parallel.zero import full_optimizer_state

META_FILENAME = "meta.pt"
ZERO1_KEY = "zero1_optimizer_states"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILENAME).is_file()


def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """FQN-keyed model state; with ``full`` the tensors are consolidated on rank 0 (CPU)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_state(module: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
    """FQN-keyed optimizer state (``{"state": {fqn: ...}, "param_groups": [{"params": [fqn]}]}``)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        indexed = full_optimizer_state(optimizer)
        if not indexed:
            return {}
        names = _param_names(module)
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in indexed["param_groups"]]
        return {"state": {order[i]: s for i, s in indexed["state"].items()}, "param_groups": groups}
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def _load_zero1_state(module: nn.Module, optimizer: ZeroRedundancyOptimizer, state: dict[str, Any]) -> None:
    names = _param_names(module)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    optimizer.load_state_dict({"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups})


def save_sharded(checkpoint: dict[str, Any], path: Path, zero1: bool) -> None:
    """Write ``checkpoint`` as a DCP directory (collective: every rank calls it)."""
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    for idx, optim in enumerate(checkpoint.pop("optimizer_states", [])):
        if zero1:
            checkpoint.setdefault(ZERO1_KEY, {})[idx] = optim
        else:
            state[f"optimizer_{idx}"] = optim
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        torch.save(checkpoint, path / META_FILENAME)


def load_into(
    module: nn.Module, optimizers: list[Optimizer], path: Path, strict: bool
) -> dict[str, Any]:
    """Load model and optimizer states from ``path`` (directory or file) in place; return the rest."""
    if is_sharded_checkpoint(path):
        meta: dict[str, Any] = torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)
        state: dict[str, Any] = {"state_dict": model_state(module, full=False)}
        for idx, opt in enumerate(optimizers):
            if not isinstance(opt, ZeroRedundancyOptimizer):
                state[f"optimizer_{idx}"] = optimizer_state(module, opt, full=False)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
        for idx, opt in enumerate(optimizers):
            if isinstance(opt, ZeroRedundancyOptimizer):
                _load_zero1_state(module, opt, meta[ZERO1_KEY][idx])
            else:
                set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"])
        return meta
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint["state_dict"], options=options)
    for opt, opt_state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        if isinstance(opt, ZeroRedundancyOptimizer):
            _load_zero1_state(module, opt, opt_state)
        else:
            set_optimizer_state_dict(module, opt, opt_state, options=options)
    return checkpoint
