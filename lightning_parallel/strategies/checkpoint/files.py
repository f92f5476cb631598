"""Checkpoints keyed by the original parameter names, whatever the layout.

Model and optimizer states go through ``torch.distributed.checkpoint`` (DCP): its state-dict
API returns parameters under their original FQNs (DTensor shards under sharding, full tensors
otherwise), so a checkpoint written under one layout loads under another. Two formats:

* sharded (default): a directory; each rank writes its own shards with ``dcp.save`` and rank 0
  writes the rest of Lightning's checkpoint (loops, callbacks, schedulers) to ``meta.pt``;
* full: one ``torch.save`` file on rank 0 holding consolidated tensors, loadable anywhere.

A sharded save is written to ``<path>.partial`` and renamed into place only after every rank
finished and ``meta.pt`` (written last) exists: a save interrupted part way (a rank killed
mid-write) leaves the previous checkpoint intact, and a directory without ``meta.pt`` is never
taken for a checkpoint. Loading compares every shape first and names the parameter and both
shapes on a mismatch: never a silent partial load.

Under pipeline parallelism each rank saves and loads only what its stages keep, model and
optimizer state alike (:mod:`lightning_parallel.strategies.checkpoint.pipeline`). A consolidated file is read by rank 0 alone
(memory-mapped) and broadcast tensor by tensor, each rank keeping its shard: no rank loads the
whole file, and no rank but 0 ever holds the whole model at once.

ZeRO-1's ``ZeroRedundancyOptimizer`` is not understood by DCP's optimizer API. In a sharded save
each rank writes its own partition of the state, keyed by FQN in the layout DCP's optimizer API
gives every other optimizer (:func:`zero1_local_state`), so no rank gathers the whole state and a
ZeRO-1 checkpoint loads into any layout, and any layout's into ZeRO-1, each rank reading only the
states of the parameters it steps. A consolidated file holds it gathered on rank 0, as every
optimizer's. (Sharded checkpoints written before kept it consolidated in ``meta.pt``
(``ZERO1_KEY``); they still load.)

Every read is weights-only unless the user passes ``weights_only=False`` (:mod:`.safe_load`), and
everything written here (loop and RNG states, ZeRO-1 partitions, layout records) is tensors,
primitives and containers, so a checkpoint of this package also loads with plain
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import shutil
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

from lightning_parallel.compat import process_group_device
from lightning_parallel.parallel.tensor.checkpoint_layout import checkpoint_layout, restore_layout
from lightning_parallel.parallel.tensor.rank_order_state import full_states_stored, model_order, optimizer_model_order
from lightning_parallel.parallel.data.zero1 import full_optimizer_state
from lightning_parallel.strategies.checkpoint.safe_load import dcp_load, load_file, read_metadata, read_on_rank0

META_FILENAME = "meta.pt"
ZERO1_KEY = "zero1_optimizer_states"


def local_path(path: str, what: str) -> Path:
    """``path`` as a local ``Path``; an fsspec URL (``s3://b/x``) is refused with a clear error.

    ``Path("s3://b/x")`` is ``s3:/b/x``: a silent wrong path. Sharded saves and every load here
    read and write through the local file system (DCP's ``FileSystemWriter``/``Reader``,
    ``torch.load``), so a URL is an error; consolidated saves pass the string on to Lightning's
    checkpoint IO, which writes URLs itself.
    """
    scheme, sep, _ = path.partition("://")
    if sep and scheme not in ("", "file"):
        from lightning_parallel.errors import config_error

        raise config_error(
            ValueError,
            "checkpoint path",
            path,
            f"{what} needs a local or mounted file system path (fsspec URLs are written only by consolidated saves)",
            "save with HybridParallelStrategy(save_distributed_checkpoint=False), or use a mounted path",
        )
    return Path(path[len("file://"):] if scheme == "file" else path)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILENAME).is_file()


def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """FQN-keyed model state; with ``full`` the tensors are consolidated on rank 0 (CPU). Always in
    the model's order (rank-ordered parameters: :mod:`~lightning_parallel.parallel.tensor.rank_order_state`)."""
    return model_order(get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=full)), module)


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def zero1_local_state(module: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's partition of ZeRO-1's state, FQN-keyed (no collective). The state dicts are the
    local optimizer's own, so a DCP load into them fills its state in place; the param groups are
    the global ones (every parameter's FQN), the same on every rank."""
    names = _param_names(module)
    local = optimizer.optim
    state = {names[id(p)]: local.state[p] for g in local.param_groups for p in g["params"] if local.state.get(p)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _zero1_template(module: nn.Module, optimizer: ZeroRedundancyOptimizer, path: Path, idx: int,
                    weights_only: bool | None) -> dict[str, Any]:
    """What a sharded load fills for ZeRO-1 on this rank: the states of its partition that the
    checkpoint holds. A fresh optimizer has no state yet: one step with zero gradients at lr 0 (on
    the local optimizer, no collective; parameters unchanged) creates it with the right shapes,
    and a parameter the checkpoint holds no state for (it had no gradient then) is left without."""
    local = optimizer.optim
    params = [p for g in local.param_groups for p in g["params"]]
    if params and not any(local.state.get(p) for p in params):
        grads = [p.grad for p in params]
        lrs = [g["lr"] for g in local.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in local.param_groups:
            g["lr"] = 0.0
        local.step()
        for p, grad in zip(params, grads):
            p.grad = grad
        for g, lr in zip(local.param_groups, lrs):
            g["lr"] = lr
    saved = set(read_metadata(path, weights_only).state_dict_metadata)
    names = _param_names(module)
    prefix = f"optimizer_{idx}.state."
    for p in params:
        if local.state.get(p) and not any(f"{prefix}{names[id(p)]}.{k}" in saved for k in local.state[p]):
            local.state.pop(p)
    return zero1_local_state(module, optimizer)


def _set_zero1_state(module: nn.Module, optimizer: ZeroRedundancyOptimizer, loaded: dict[str, Any]) -> None:
    """Put a loaded partition (see :func:`_zero1_template`) into the local optimizer, and the saved
    hyper-parameters into the global param groups (ZeroRedundancyOptimizer copies them to the
    local optimizer at its step)."""
    names = _param_names(module)
    local = optimizer.optim
    for p in (p for g in local.param_groups for p in g["params"]):
        if names[id(p)] in loaded["state"]:
            local.state[p] = dict(loaded["state"][names[id(p)]])
    for group, saved in zip(optimizer.param_groups, loaded.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})


def optimizer_state(module: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
    """FQN-keyed optimizer state (``{"state": {fqn: ...}, "param_groups": [{"params": [fqn]}]}``)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer) and not full:
        return zero1_local_state(module, optimizer)  # a sharded save: each rank writes its partition
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        indexed = full_optimizer_state(optimizer)
        if not indexed:
            return {}
        names = _param_names(module)
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in indexed["param_groups"]]
        return {"state": {order[i]: s for i, s in indexed["state"].items()}, "param_groups": groups}
    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    return optimizer_model_order(state, module)


def _load_zero1_state(module: nn.Module, optimizer: ZeroRedundancyOptimizer, state: dict[str, Any]) -> None:
    names = _param_names(module)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    optimizer.load_state_dict({"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups})


def split_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Move the tensors DCP writes (model, sharded optimizer states) out of ``checkpoint`` into
    the returned state; what stays in ``checkpoint`` (loops, callbacks, schedulers) is written by
    rank 0 as ``meta.pt``."""
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    for idx, optim in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim
    # Packed tensor-parallel parameters (GPT-2's c_attn, gate_up_proj, experts: _StridedShard) are
    # several boxes per rank, which dcp.save refuses ("overlapping chunks"); as plain Shard they are one.
    return checkpoint_layout(state)


def begin_sharded_save(path: Path) -> Path:
    """Create the empty scratch directory of a save of ``path`` (collective: a barrier); return it."""
    partial, _ = _scratch_names(path)
    if dist.get_rank() == 0:
        _remove(partial)
        partial.mkdir(parents=True)
    dist.barrier()
    return partial


def finish_sharded_save(meta: dict[str, Any], path: Path) -> None:
    """Rank 0, once every rank's shards are in the scratch directory: add ``meta.pt`` and put the
    directory in place of ``path``. Until this rename, ``path`` is the previous complete save."""
    if dist.get_rank() != 0:
        return
    partial, previous = _scratch_names(path)
    torch.save(meta, partial / META_FILENAME)
    _remove(previous)
    if path.exists():
        path.rename(previous)
    partial.rename(path)
    _remove(previous)


def save_sharded(checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` as a DCP directory (collective: every rank calls it)."""
    state = split_checkpoint(checkpoint)
    partial = begin_sharded_save(path)
    dcp.save(state, checkpoint_id=str(partial))
    finish_sharded_save(checkpoint, path)
    dist.barrier()


def _scratch_names(path: Path) -> tuple[Path, Path]:
    """Where a save is written before it replaces ``path``, and where the previous one waits meanwhile.

    Neither name contains ``path``'s own name: Lightning's ``ckpt_path="last"`` takes the newest
    entry of the checkpoint directory whose name *contains* "last", so ``last.ckpt.partial`` (a
    save interrupted by a crash) would be chosen over the complete ``last.ckpt``. Hidden names
    from a digest of the name keep one scratch pair per checkpoint and out of Lightning's way.
    """
    digest = hashlib.sha1(path.name.encode()).hexdigest()[:12]
    return path.with_name(f".lp-{digest}.partial"), path.with_name(f".lp-{digest}.previous")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: Path) -> None:
    """Refuse a checkpoint whose tensors do not fit the model, naming the parameter and both shapes."""
    for name, shape in expected.items():
        if name in found and tuple(found[name]) != tuple(shape):
            raise ValueError(
                f"Checkpoint {source} does not fit the model: `{name}` has shape {tuple(found[name])} in the"
                f" checkpoint and {tuple(shape)} in the model. HINT: build the model with the configuration it"
                " was saved with (its hyper-parameters are in the checkpoint), or load another checkpoint."
            )


def _sharded_model_shapes(path: Path, weights_only: bool | None) -> dict[str, tuple[int, ...]]:
    metadata = read_metadata(path, weights_only).state_dict_metadata
    prefix = "state_dict."
    return {k[len(prefix):]: tuple(v.size) for k, v in metadata.items() if k.startswith(prefix) and hasattr(v, "size")}


def load_into(
    module: nn.Module, optimizers: list[Optimizer], path: Path, strict: bool, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load model and optimizer states from ``path`` (directory or file) in place; return the rest.

    Every file is read weights-only unless ``weights_only`` is ``False`` (see :mod:`.safe_load`); a
    sharded directory is read by every rank (a refusal stops all of them at once, before any
    collective), a consolidated file by rank 0, which sends a refusal to the others."""
    if is_sharded_checkpoint(path):
        meta: dict[str, Any] = load_file(path / META_FILENAME, weights_only)
        full_states: dict[int, Any] = meta.get(ZERO1_KEY, {})  # a ZeRO-1 save of an earlier version: consolidated
        state: dict[str, Any] = {"state_dict": model_state(module, full=False)}
        check_shapes({k: tuple(v.shape) for k, v in state["state_dict"].items()}, _sharded_model_shapes(path, weights_only), path)
        for idx, opt in enumerate(optimizers):
            if idx in full_states:
                continue
            if isinstance(opt, ZeroRedundancyOptimizer):
                state[f"optimizer_{idx}"] = _zero1_template(module, opt, path, idx, weights_only)
            else:
                state[f"optimizer_{idx}"] = optimizer_state(module, opt, full=False)
        template = checkpoint_layout(state)  # packed tp parameters as plain Shard: one box per rank for DCP
        dcp_load(template, path, weights_only)
        state = restore_layout(template, state)
        set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
        for idx, opt in enumerate(optimizers):
            if idx in full_states:
                _load_full_optimizer_state(module, opt, full_states[idx])
            elif isinstance(opt, ZeroRedundancyOptimizer):
                _set_zero1_state(module, opt, state[f"optimizer_{idx}"])
            else:
                set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"])
        return meta
    return _load_consolidated(module, optimizers, path, strict, weights_only)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _header(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What every rank needs of a consolidated checkpoint besides its tensors (small: no tensors)."""
    return {
        "rest": {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")},
        "shapes": {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items() if isinstance(v, torch.Tensor)},
    }


def _read_consolidated(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the checkpoint, memory-mapped, on rank 0 and ``{}`` elsewhere; its header on every rank)."""
    checkpoint, header = read_on_rank0(path, lambda: load_file(path, weights_only, mmap=True), _header)
    return checkpoint or {}, header


def read_rest(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A checkpoint without its model and DCP-written optimizer tensors (loops, callbacks, schedulers)."""
    if is_sharded_checkpoint(path):
        return load_file(path / META_FILENAME, weights_only)
    return _read_consolidated(path, weights_only)[1]["rest"]


def _collective_device(module: nn.Module) -> torch.device:
    """Where this rank's broadcasts run: its parameters' device (the root device), or, for parameters
    kept on the CPU (``cpu_offload``), the default process group's device."""
    for tensor in module.parameters():
        if not tensor.is_meta and tensor.device != torch.device("cpu"):
            return tensor.device
    return process_group_device()


def _load_consolidated(module: nn.Module, optimizers: list[Optimizer], path: Path, strict: bool,
                       weights_only: bool | None) -> dict[str, Any]:
    """A consolidated file into any eager layout: rank 0 reads it (memory-mapped) and broadcasts it
    tensor by tensor; each rank keeps its shard (:func:`.pipeline_checkpoint.load_held_consolidated`,
    with every tensor held), and under ZeRO-1 the optimizer states of its partition only. One
    process loads it directly."""
    if not _distributed():
        checkpoint, header = _read_consolidated(path, weights_only)
        check_shapes({k: tuple(v.shape) for k, v in model_state(module, full=False).items()}, header["shapes"], path)
        set_model_state_dict(module, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True, strict=strict))
        for opt, opt_state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            _load_full_optimizer_state(module, opt, opt_state)
        return header["rest"]
    from lightning_parallel.strategies.checkpoint.pipeline import load_held_consolidated

    device = _collective_device(module)
    # ZeRO-1 steps only its partition: its local optimizer is the target, so a rank keeps the states
    # of the parameters it steps and drops the others as they are broadcast (never the whole state).
    targets = [opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt for opt in optimizers]
    rest = load_held_consolidated(module, targets, path, strict, {}, device, weights_only)
    for opt in optimizers:
        if isinstance(opt, ZeroRedundancyOptimizer):  # it copies its global groups to the local ones at each step
            for group, local in zip(opt.param_groups, opt.optim.param_groups):
                group.update({k: v for k, v in local.items() if k != "params"})
    return rest


def _load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a consolidated, FQN-keyed optimizer state into any layout (each rank keeps its part)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _load_zero1_state(module, optimizer, state)
    elif not state.get("state"):
        # A stateless optimizer (SGD without momentum): nothing per parameter to place, and torch's
        # full-state loader asserts on the device of a state it has none of. Hyperparameters only.
        for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({k: v for k, v in saved.items() if k != "params"})
    else:
        state = full_states_stored(state, module, optimizer=True)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
