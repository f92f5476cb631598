"""Data parallelism: replicated (DDP) and sharded (FSDP2) over the data-parallel mesh axes.

How the ZeRO stages map onto torch (what each rank holds between steps, for P parameters,
N data-parallel ranks):

=====  ==========================================================  ===========================
stage  torch mechanism                                             held per rank
=====  ==========================================================  ===========================
0      ``DistributedDataParallel``: bucketed all-reduce of grads    params P, grads P, optim P
       overlapped with backward
1      DDP + ``ZeroRedundancyOptimizer``: grads all-reduced, each   params P, grads P, optim P/N
       rank updates its 1/N of the params and broadcasts them
2      FSDP2 ``fully_shard(reshard_after_forward=False)``: params   params P/N (+P during the
       gathered once per step and kept until backward, grads         step), grads P/N, optim P/N
       reduce-scattered
3      FSDP2 ``fully_shard(reshard_after_forward=True)``: params    params P/N (+1 block at a
       gathered per block in forward and again in backward          time), grads P/N, optim P/N
=====  ==========================================================  ===========================

ZeRO-2 on FSDP2 also shards the parameters at rest, which the original ZeRO-2 does not; it
never holds more than the original does. CPU offload (FSDP2 ``CPUOffloadPolicy``) keeps the
sharded params, grads and optimizer step on the CPU. HSDP is FSDP2 on a 2D
``(dp_replicate, dp_shard)`` mesh: shard within a node, all-reduce across nodes (the seeds'
topology-aware communication).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.parallel.data.fsdp_host import release_host_buffers

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16": torch.bfloat16, "16": torch.float16}


def mixed_precision_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The compute dtype of a Lightning-style precision string ("bf16-mixed", ...), or None for fp32."""
    if mixed_precision in (None, "32", "32-true", "fp32"):
        return None
    return _DTYPES[mixed_precision]


def apply_ddp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
) -> DistributedDataParallel:
    """Wrap ``module`` in torch's DDP over the flattened data-parallel axis.

    Gradient buckets are all-reduced as soon as they fill during backward, overlapping
    communication with the rest of backward; ``gradient_as_bucket_view`` avoids a copy.
    """
    device = next(module.parameters()).device
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
    )


def apply_fsdp(
    root: nn.Module,
    blocks: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    own_meshes: Sequence[tuple[nn.Module, DeviceMesh]] = (),
    split_blocks: bool = False,
) -> FSDPModule:
    """Shard ``blocks`` one FSDP2 unit each, then ``root`` (which takes the remaining params).

    ``split_blocks``: each block's large sublayers (attention, MLP: :func:`sublayer_units`) become
    units of their own inside the block's unit, which then keeps only the rest (norms).

    ``dp_mesh`` is 1D (FSDP) or 2D ``(replicate, shard)`` (HSDP). Parameter names do not change.
    ``mixed_precision`` ("bf16-mixed", "16-mixed"): parameters are gathered and computed in that
    dtype, gradients reduced in fp32 and kept fp32 in the shards (fp32 master weights); the root
    does not cast its inputs. None: fp32 throughout, so parity with fp32 single-process training
    holds. ``own_meshes`` are modules sharded first on a mesh of their own: experts, whose
    gradients are averaged over the ``edp`` ranks only.
    """
    dtype = mixed_precision_dtype(mixed_precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    # The root's inputs are whatever it is called with (a strategy's step wrapper: the user's
    # batch): targets, masks and integer inputs are never cast; blocks cast their activations.
    root_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for module, mesh in own_meshes:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    for block in blocks:
        for sublayer in sublayer_units(block) if split_blocks else ():
            fully_shard(sublayer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    # Embeddings and the head as units of their own (as torchtitan does): the root's params stay
    # gathered from its forward to the end of backward, so it must hold nothing large.
    for group, reshards in outer_units(root, blocks):
        fully_shard(group if len(group) > 1 else group[0], mesh=dp_mesh, reshard_after_forward=reshard_after_forward and reshards,
                    mp_policy=mp_policy, offload_policy=offload)
    # The root's params are used first in forward and last in backward: never reshard them early.
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=root_policy, offload_policy=offload)
    assert isinstance(root, FSDPModule)
    release_host_buffers(fsdp_modules(root), torch.device(dp_mesh.device_type))  # CPU: nothing kept for streams
    return root


def sublayer_units(block: nn.Module, min_fraction: float = 1 / 4) -> list[nn.Module]:
    """The parts of ``block`` that get an FSDP2 unit of their own under ``fsdp_units="sublayer"``:
    its direct children (through single-child wrappers such as activation checkpointing's) that
    hold at least ``min_fraction`` of its parameters: a transformer block's attention and MLP.

    Why: during a unit's backward FSDP2 holds its gathered parameters, its unsharded gradients,
    the reduce-scatter's copy of them and the next unit's prefetched parameters, about four units'
    worth on top of the sharded state; with the block as the unit that is four blocks (on the 1 GiB
    GPT of ``benchmarks/bench_memory.py`` on 4 ranks, 220 MiB above the 513 MiB held state). Halving the
    unit halves it, for one more unit per block (each costs its hooks, copies and collectives per
    step: 1.4-3.8 ms on two CPU ranks, see :func:`outer_units`), hence an option, not the default.
    Left out: tensor-parallel children (DTensor parameters; their outputs are views, on which an
    in-place op drops FSDP2's pre-backward hook) and children already sharded (experts)."""
    body = block
    while len(children := [c for c in body.children() if any(True for _ in c.parameters())]) == 1:
        body = children[0]
    total = sum(p.numel() for p in block.parameters())
    return [
        child for child in children
        if sum(p.numel() for p in child.parameters()) >= min_fraction * total
        and not any(isinstance(m, FSDPModule) for m in child.modules())
        and not any(isinstance(p, DTensor) for p in child.parameters())
    ]


def outer_units(root: nn.Module, blocks: Sequence[nn.Module], min_fraction: float = 1 / 4) -> list[tuple[list[nn.Module], bool]]:
    """The modules outside ``blocks`` that get an FSDP2 unit of their own, grouped, each with
    whether it may reshard after forward.

    Why: whatever stays in the root unit is gathered for the whole step and its gradients are
    reduce-scattered last, when every other gradient shard already exists; an embedding or an LM
    head left there costs about 3 x its size at the step's peak (measured: zero3 on a 1 GiB GPT,
    4 ranks, training peak 797 -> 733 MiB). Candidates are the largest subtrees outside the
    blocks that contain no block and no unit already sharded (experts); one is kept if it holds
    at least ``min_fraction`` of the smallest block's parameters. Smaller ones (norms, position
    tables, the embedding of a small vocabulary) stay in the root: a unit's cost is fixed (hooks,
    copy-in and copy-out, an all-gather and a reduce-scatter per step; measured 1.4-3.8 ms per unit
    and step on two CPU ranks with gloo), while what it saves at the peak is about twice its size,
    against the three to four blocks FSDP2 holds there; below a quarter of a block that is under
    an eighth of that working set. (On the ZeRO-3 benchmark's GPT, 4 x 256, vocabulary 512,
    embedding and head are 0.17 of a block each: their two units cost about 2.5% of the step's CPU
    time, measured once on a loaded machine.)

    Kept in the root instead: modules sharing a parameter with the root's own parameters or a
    block; and tensor-parallel modules (DTensor parameters), whose outputs are views: an in-place
    op on a view drops FSDP2's pre-backward hook (torch warns), which the root unit never needs.
    Modules sharing a parameter (tied embeddings) form one group. Only a group of embeddings
    reshards after forward: if an in-place op on its output drops the pre-backward all-gather,
    its backward still never reads the weight and the root's final callback reduces its
    gradient; any other unit stays gathered from its forward to its backward, as the root did.
    """
    block_ids = {id(b) for b in blocks}
    if not block_ids:
        return []
    sharded = {id(m) for m in root.modules() if isinstance(m, FSDPModule)}
    candidates: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in block_ids:
                continue
            if any(id(m) in block_ids or id(m) in sharded for m in child.modules()):
                walk(child)
            elif any(True for _ in child.parameters()):
                candidates.append(child)

    walk(root)
    # Union modules that share a parameter (union-find over the candidates).
    owner: dict[int, int] = {}
    parent = list(range(len(candidates)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, module in enumerate(candidates):
        for param in module.parameters():
            parent[find(i)] = find(owner.setdefault(id(param), i))
    elsewhere = {id(p) for b in blocks for p in b.parameters()}
    elsewhere |= {id(p) for p in root.parameters(recurse=False)}
    elsewhere |= {id(p) for m in root.modules() if id(m) in sharded for p in m.parameters()}
    smallest = min(sum(p.numel() for p in b.parameters()) for b in blocks)
    groups: dict[int, list[nn.Module]] = {}
    for i, module in enumerate(candidates):
        groups.setdefault(find(i), []).append(module)
    units: list[tuple[list[nn.Module], bool]] = []
    for members in groups.values():
        params = {id(p): p for m in members for p in m.parameters()}
        if (params.keys() & elsewhere or any(isinstance(p, DTensor) for p in params.values())
                or sum(p.numel() for p in params.values()) < min_fraction * smallest):
            continue
        units.append((members, all(isinstance(m, nn.Embedding) for m in members)))
    return units


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]
