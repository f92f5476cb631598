"""Pipeline checkpoints without full copies: each rank saves and loads only what its stages keep.

A traced pipeline rank holds its stages' parameters (tensor-parallel or ZeRO shards as DTensors)
and empty, released copies of the others. Checkpoints keep the unsplit model's FQNs, so a file
written here loads under any layout and the other way round:

* **Sharded save** (DCP, the default): each parameter, buffer and optimizer state entry comes
  from the one pipeline rank that *keeps* it (``keepers``: FQN -> pipeline rank, the lowest
  rank whose stages use it; a tied weight used by two stages is written once), as the tensor or
  DTensor shard the rank already holds. No collective runs to build these states; DCP then
  writes each rank's entries into its own file.
* **Sharded load**: each rank asks DCP for exactly the entries its stages hold (a DTensor shard
  reads its slice), model and optimizer alike, so no rank reads another stage's tensors.
* **Consolidated save** (one file, ``save_distributed_checkpoint=False``): global rank 0 writes
  the file, so it alone receives each tensor, one at a time, from the rank keeping it
  (point-to-point); the other ranks never hold another stage's tensors.
* **Consolidated load**: global rank 0 memory-maps the file and broadcasts it tensor by tensor
  (what DCP's ``broadcast_from_rank0`` does for eager layouts); each rank keeps its slice of the
  tensors its stages hold and drops the rest before the next one arrives.

Optimizer state is keyed ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn]}]}``,
the form ``torch.distributed.checkpoint.state_dict`` uses for eager layouts. State that does not
exist yet when a checkpoint is loaded (the optimizer has not stepped) is created first by one
step with zero gradients and learning rate 0 on the parameters this rank holds (as DCP's own
state-dict API does), then overwritten by the checkpoint's values.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_parallel.parallel.pipeline.tensor import full_value
from lightning_parallel.parallel.tensor.checkpoint_layout import checkpoint_layout, restore_layout
from lightning_parallel.parallel.tensor.rank_order import carry, mark_states, stored_whole
from lightning_parallel.strategies.checkpoint.files import check_shapes
from lightning_parallel.strategies.checkpoint.safe_load import dcp_load, load_file, read_metadata, read_on_rank0

MODEL_PREFIX = "state_dict."
_TENSOR, _VALUE = "tensor", "value"


def canonical_names(module: nn.Module) -> dict[int, str]:
    """``id(tensor)`` -> the name ``named_parameters()``/``named_buffers()`` give it first (ties share one)."""
    names: dict[int, str] = {}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        names.setdefault(id(tensor), name)
    return names


def _entries(module: nn.Module) -> list[tuple[str, str, Tensor]]:
    """(state-dict key, canonical name, tensor) for every state-dict entry, in state-dict order."""
    names = canonical_names(module)
    return [(key, names.get(id(value), key), value) for key, value in module.state_dict(keep_vars=True).items()]


def kept_model_state(module: nn.Module, keepers: dict[str, int], me: int) -> dict[str, Tensor]:
    """The state-dict entries pipeline rank ``me`` keeps, as it holds them (DTensor shards stay shards)."""
    return {key: carry(value, value.detach()) for key, name, value in _entries(module) if keepers.get(name, 0) == me}


def _param_groups(module: nn.Module, optimizer: Optimizer) -> tuple[list[dict[str, Any]], list[tuple[nn.Parameter, str]]]:
    names = {id(p): n for n, p in module.named_parameters()}
    groups, params = [], []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"The optimizer holds parameters of shapes {missing[:3]} that are not parameters of the LightningModule;"
                " a checkpoint keys optimizer state by the module's parameter names. HINT: build the optimizer in"
                " configure_optimizers() from self.parameters() (or named submodules' parameters)."
            )
        fqns = [names[id(p)] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        params += list(zip(group["params"], fqns))
    return groups, params


def kept_optimizer_state(module: nn.Module, optimizer: Optimizer, keepers: dict[str, int], me: int) -> dict[str, Any]:
    """FQN-keyed optimizer state of the parameters pipeline rank ``me`` keeps (no collective).

    Built from ``optimizer.state`` directly: a rank may hold stale state for parameters it
    released (restored before the stages were traced), which must not reach the checkpoint.
    """
    groups, params = _param_groups(module, optimizer)
    state = {name: mark_states(p, dict(optimizer.state[p])) for p, name in params  # rank_order.py
             if keepers.get(name, 0) == me and optimizer.state.get(p)}
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------- consolidated save
def _in_group(group: dist.ProcessGroup, rank: int) -> bool:
    return rank in dist.get_process_group_ranks(group)


def _to_rank0(value: Tensor | None, shape: torch.Size, dtype: torch.dtype, keeper: int, group: dist.ProcessGroup,
              me: int, device: torch.device) -> Tensor | None:
    """One tensor from pipeline rank ``keeper`` to global rank 0 (which returns it on the CPU).

    Every rank at pipeline rank ``keeper`` gathers a DTensor (a collective over its own tp/dp
    peers); of those, only the member of global rank 0's pipeline group sends it."""
    full = full_value(value) if me == keeper and isinstance(value, DTensor) else value
    if not _in_group(group, 0):
        return None
    src = dist.get_global_rank(group, keeper)
    if dist.get_rank() == 0:
        if src == 0:
            return full.detach().cpu().clone()  # type: ignore[union-attr]
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=src)
        return out.cpu()
    if me == keeper:
        dist.send(full.detach().to(device).contiguous(), dst=0)  # type: ignore[union-attr]
    return None


def model_state_to_rank0(module: nn.Module, keepers: dict[str, int], released: dict[str, torch.Size],
                         group: dist.ProcessGroup, device: torch.device) -> dict[str, Tensor]:
    """Consolidated model state on global rank 0, tensor by tensor from the keepers; ``{}`` elsewhere."""
    me = dist.get_rank(group)
    out: dict[str, Tensor] = {}
    for key, name, value in _entries(module):
        keeper = keepers.get(name, 0)
        shape = released.get(name, value.shape)
        full = _to_rank0(value if me == keeper else None, torch.Size(shape), value.dtype, keeper, group, me, device)
        if full is not None:
            out[key] = full
    return out


def optimizer_state_to_rank0(module: nn.Module, optimizer: Optimizer, keepers: dict[str, int],
                             group: dist.ProcessGroup, device: torch.device) -> dict[str, Any]:
    """Consolidated optimizer state on global rank 0; elsewhere only the parameter groups.

    The layout of every kept entry (tensor shape/dtype or plain value) is small and goes to rank 0
    as one object gather over its pipeline group; the tensors follow one by one (point-to-point)."""
    me = dist.get_rank(group)
    local = kept_optimizer_state(module, optimizer, keepers, me)
    layout = {name: {k: (_TENSOR, tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (_VALUE, v) for k, v in entries.items()}
              for name, entries in local["state"].items()}
    layouts: list[Any] = [None] * dist.get_world_size(group)
    if _in_group(group, 0):
        dist.gather_object(layout, layouts if dist.get_rank() == 0 else None, dst=0, group=group)
    if dist.get_rank() != 0:
        layouts[me] = layout
    state: dict[str, dict[str, Any]] = {}
    for keeper in range(dist.get_world_size(group)):
        if keeper != me and dist.get_rank() != 0:
            continue  # this rank neither sends nor receives the entries kept there
        for name, entries in sorted((layouts[keeper] or {}).items()):
            for key, (kind, *rest) in sorted(entries.items()):
                if kind == _VALUE:
                    state.setdefault(name, {})[key] = rest[0]
                    continue
                value = local["state"][name][key] if keeper == me else None
                full = _to_rank0(value, torch.Size(rest[0]), rest[1], keeper, group, me, device)
                if full is not None:
                    state.setdefault(name, {})[key] = full
    if dist.get_rank() != 0:
        return {"state": {}, "param_groups": local["param_groups"]}
    order = [n for g in local["param_groups"] for n in g["params"]]
    return {"state": {n: state[n] for n in order if n in state}, "param_groups": local["param_groups"]}


# ---------------------------------------------------------------------------------- loading
def held_names(module: nn.Module, released: dict[str, torch.Size]) -> set[str]:
    """Canonical names of the parameters and buffers this rank's stages hold (not released)."""
    return {name for name in canonical_names(module).values() if name not in released}


@torch.no_grad()
def init_held_state(optimizer: Optimizer, held: list[nn.Parameter]) -> None:
    """Create the optimizer state of ``held`` (zero gradients, learning rate 0, one step) if none exists.

    Why: a checkpoint is loaded into existing state tensors (DCP fills them in place, shard by
    shard). Parameters not held here keep ``grad=None``, so the step skips them."""
    if any(optimizer.state.get(p) for p in held):
        return
    previous = [p.grad for p in held]
    for p in held:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    for p, grad in zip(held, previous):
        p.grad = grad


def _place(target: Tensor, full: Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor keeps its slice)."""
    if isinstance(target, DTensor):
        whole = stored_whole(target, full.to(target.device))  # rank-ordered parameters (Phi-3's qkv_proj)
        local = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


def _missing_error(path: Path, missing: list[str]) -> ValueError:
    return ValueError(
        f"Checkpoint {path} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}. HINT: load a checkpoint"
        " of this model, or set `self.strict_loading = False` in the LightningModule to keep those tensors as built."
    )


@torch.no_grad()
def place_full_optimizer_state(module: nn.Module, optimizer: Optimizer, saved: dict[str, Any], held: set[str]) -> None:
    """Load a consolidated, FQN-keyed optimizer state (already in memory: ZeRO-1 checkpoints keep it in
    ``meta.pt``) into this rank's stages: each held parameter's entries, sliced to its layout."""
    _, params = _param_groups(module, optimizer)
    init_held_state(optimizer, [p for p, name in params if name in held])
    for group, hyper in zip(optimizer.param_groups, saved.get("param_groups", [])):
        group.update({k: v for k, v in hyper.items() if k != "params"})
    state = saved.get("state", {})
    for p, name in params:
        if name not in held or not optimizer.state.get(p):
            continue
        if name not in state:
            del optimizer.state[p]  # saved before it stepped: start fresh
            continue
        live = mark_states(p, optimizer.state[p])
        for k, value in state[name].items():
            if isinstance(value, Tensor) and isinstance(live.get(k), Tensor):
                _place(live[k], value)
            else:
                live[k] = value


def load_held_sharded(module: nn.Module, optimizers: Iterable[Optimizer], path: Path, strict: bool,
                      released: dict[str, torch.Size], full_states: dict[int, Any] | None = None,
                      weights_only: bool | None = None) -> None:
    """Read from the DCP directory ``path`` exactly the entries this rank's stages hold (a collective).

    ``full_states``: optimizer index -> the consolidated state a ZeRO-1 run stored in ``meta.pt``
    (not in the DCP files), placed by :func:`place_full_optimizer_state` instead. Metadata and
    non-tensor entries are read weights-only unless ``weights_only`` is ``False`` (:mod:`.safe_load`)."""
    metadata = read_metadata(path, weights_only).state_dict_metadata
    full_states = full_states or {}
    held = held_names(module, released)
    model = {key: carry(value, value.detach()) for key, name, value in _entries(module) if name in held}
    found = {k[len(MODEL_PREFIX):]: tuple(v.size) for k, v in metadata.items() if k.startswith(MODEL_PREFIX) and hasattr(v, "size")}
    check_shapes({k: tuple(v.shape) for k, v in model.items()}, found, path)
    missing = sorted(k for k in model if k not in found)
    if missing and strict:
        raise _missing_error(path, missing)
    template: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in model.items() if k in found}
    values: list[tuple[dict[str, Any], str, str]] = []  # (container, key in it, template key) for plain values
    absent: list[tuple[Optimizer, nn.Parameter]] = []
    for idx, optimizer in enumerate(optimizers):
        if idx in full_states:
            place_full_optimizer_state(module, optimizer, full_states[idx], held)
            continue
        groups, params = _param_groups(module, optimizer)
        init_held_state(optimizer, [p for p, name in params if name in held])
        for i, group in enumerate(optimizer.param_groups):
            for hp in group:
                key = f"optimizer_{idx}.param_groups.{i}.{hp}"
                if hp != "params" and key in metadata:
                    template[key] = group[hp]
                    values.append((group, hp, key))
        for p, name in params:
            entries = optimizer.state.get(p) if name in held else None
            if not entries:
                continue
            keys = {k: f"optimizer_{idx}.state.{name}.{k}" for k in entries}
            if not any(key in metadata for key in keys.values()):
                absent.append((optimizer, p))  # no state saved for it (it had not stepped): start fresh
                continue
            for k, key in keys.items():
                if key in metadata:
                    template[key] = carry(mark_states(p, entries)[k], entries[k].detach()) if isinstance(entries[k], Tensor) else entries[k]
                    if not isinstance(entries[k], Tensor):
                        values.append((entries, k, key))
    # Packed tensor-parallel parameters (_StridedShard) are read as plain Shard (one box per rank) and put back.
    laid = checkpoint_layout(template)
    dcp_load(laid, path, weights_only)
    for key, value in restore_layout(laid, template).items():
        if isinstance(value, DTensor) and value is not template[key]:
            template[key].to_local().copy_(value.to_local())
    for container, k, key in values:
        container[k] = laid[key]
    for optimizer, p in absent:
        del optimizer.state[p]


def _consolidated_header(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """What every rank needs of a consolidated file besides its tensors: the rest of the checkpoint,
    and the shape and dtype of each model and optimizer tensor (plain values travel as they are)."""
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    model = {k: (tuple(v.shape), v.dtype) for k, v in checkpoint["state_dict"].items() if isinstance(v, Tensor)}
    optim = [{"param_groups": s.get("param_groups", []),
              "state": {n: {k: (_TENSOR, tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (_VALUE, v)
                            for k, v in entries.items()} for n, entries in s.get("state", {}).items()}}
             for s in checkpoint.get("optimizer_states", [])]
    return rest, model, optim


def load_held_consolidated(module: nn.Module, optimizers: list[Optimizer], path: Path, strict: bool,
                           released: dict[str, torch.Size], device: torch.device,
                           weights_only: bool | None = None) -> dict[str, Any]:
    """Load a consolidated file: rank 0 memory-maps it and broadcasts it tensor by tensor; every rank
    keeps its slice of what its stages hold. Returns the rest of the checkpoint (loops, callbacks).

    Also the loader of eager layouts (``released`` empty: every tensor held). Why not DCP's
    ``broadcast_from_rank0``: it slices by offset, which is wrong for packed tensor-parallel
    parameters (``_StridedShard``: GPT-2's ``c_attn``); ``distribute_tensor`` here slices them
    right. A ZeRO-1 run passes its local optimizer: a rank keeps the states of its partition only.
    The file is read weights-only unless ``weights_only`` is ``False``; a refusal on rank 0 is sent to
    every rank in place of the header, so all raise it together (:func:`.safe_load.read_on_rank0`)."""
    loaded, (rest, model_layout, optim_layouts) = read_on_rank0(
        path, lambda: load_file(path, weights_only, mmap=True), _consolidated_header)
    checkpoint: dict[str, Any] = loaded or {}
    held = held_names(module, released)
    targets = {key: carry(value, value.detach()) for key, name, value in _entries(module) if name in held}
    check_shapes({k: tuple(v.shape) for k, v in targets.items()}, {k: s for k, (s, _) in model_layout.items()}, path)
    missing = sorted(k for k in targets if k not in model_layout)
    if missing and strict:
        raise _missing_error(path, missing)
    unexpected = sorted(set(model_layout) - {key for key, _, _ in _entries(module)})
    if unexpected and strict:
        raise ValueError(
            f"Checkpoint {path} holds {len(unexpected)} tensors the model does not have, e.g. {unexpected[:5]}."
            " HINT: load a checkpoint of this model, or set `self.strict_loading = False` in the LightningModule."
        )

    def receive(shape: tuple[int, ...], dtype: torch.dtype, source: Any) -> Tensor:
        full = source().to(device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(full, src=0)
        return full

    with torch.no_grad():
        for key, (shape, dtype) in model_layout.items():
            full = receive(shape, dtype, lambda: checkpoint["state_dict"][key])
            if key in targets:
                _place(targets[key], full)
        for idx, (optimizer, layout) in enumerate(zip(optimizers, optim_layouts)):
            groups, params = _param_groups(module, optimizer)
            by_name = {name: p for p, name in params}
            init_held_state(optimizer, [p for p, name in params if name in held])
            for group, saved in zip(optimizer.param_groups, layout["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            for name, entries in layout["state"].items():
                p = by_name.get(name)
                live = optimizer.state.get(p) if p is not None and name in held else None
                for k, (kind, *spec) in entries.items():
                    if kind == _VALUE:
                        if live is not None:
                            live[k] = spec[0]
                        continue
                    full = receive(spec[0], spec[1], lambda: checkpoint["optimizer_states"][idx]["state"][name][k])
                    if live is not None and isinstance(live.get(k), Tensor):
                        _place(mark_states(p, live)[k], full)
                    elif live is not None:
                        live[k] = full.cpu() if full.dim() == 0 else full
            for p, name in params:
                if name in held and name not in layout["state"] and optimizer.state.get(p):
                    del optimizer.state[p]  # saved before it stepped: start fresh
    return rest
