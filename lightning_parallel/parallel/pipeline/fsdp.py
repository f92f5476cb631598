"""ZeRO over the data-parallel axis inside pipeline stages: FSDP2 ``fully_shard`` on each stage module.

DeepSpeed and Colossal-AI allow only ZeRO-1 with pipelines, because ZeRO-2/3 reduce (and
ZeRO-3 gathers) per backward, and a pipeline runs one backward per microbatch. torch's
pipeline schedules know FSDP2 modules: they keep gradients unreduced until a stage's last
microbatch (``set_requires_gradient_sync``), reshard after it, and run FSDP's post-backward
themselves. So each local training stage module becomes one FSDP2 unit on the data-parallel
mesh, after tensor parallelism (whose DTensor parameters FSDP2 then shards over the data axes,
as torchtitan composes FSDP2 with TP).

Two things ``fully_shard`` does not know about here, handled below:

* The stage modules share ``Parameter`` objects with the user's LightningModule (its optimizer,
  checkpoints, clipping) and with the forward-only evaluation stages. ``fully_shard`` registers
  new sharded parameters on the training stage only: the same objects are registered in the
  LightningModule and the evaluation stages under the same names, and optimizers are pointed
  at them (:func:`~lightning_parallel.parallel.pipeline.tensor.swap_optimizer_parameters`).
* The evaluation stages are not FSDP units, so :func:`unsharded_for_eval` gathers the training
  stages' parameters and lends those full parameters to the evaluation stages for the step. Where
  a training stage module serves evaluation too (:mod:`~lightning_parallel.parallel.pipeline.eval_reuse`),
  it is the FSDP unit itself and needs no lending.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_parallel.parallel.data.fsdp_host import release_host_buffers
from lightning_parallel.parallel.pipeline.tensor import replace_parameters


def apply_stage_fsdp(
    module: nn.Module,
    train_stages: Sequence[nn.Module],
    eval_stages: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    ignored: set[nn.Parameter] | None = None,
) -> dict[nn.Parameter, nn.Parameter]:
    """Shard each training stage's parameters over ``dp_mesh``; return old -> new parameter.

    ``reshard_after_forward``: ZeRO-3 (gather again for each microbatch's backward) when True,
    ZeRO-2 (parameters stay gathered from a microbatch's forward to its backward) when False.
    ``ignored``: parameters to leave whole (not in the mapping; the caller reduces their gradients).
    """
    mapping: dict[nn.Parameter, nn.Parameter] = {}
    ignored = ignored or set()
    for stage in train_stages:
        before = {name: p for name, p in stage.named_parameters() if p not in ignored}
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params={p for p in stage.parameters() if p in ignored} or None)
        after = dict(stage.named_parameters())
        mapping.update({before[name]: after[name] for name in before})
    release_host_buffers([s for s in train_stages if isinstance(s, FSDPModule)], torch.device(dp_mesh.device_type))
    replace_parameters([module, *(s for s in eval_stages if s not in train_stages)], {id(old): new for old, new in mapping.items()})
    return mapping


@contextmanager
def unsharded_for_eval(train_stages: Sequence[nn.Module], eval_stages: Sequence[nn.Module]) -> Iterator[None]:
    """Lend the evaluation stages the gathered parameters of the matching training stages.

    A training stage and the evaluation stage of the same index are cut from one module at the
    same points, so they name the same parameters; every rank of the data-parallel group calls
    this together (the gather is a collective).
    """
    units = [s for s in train_stages if isinstance(s, FSDPModule)]
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
    lent: list[tuple[nn.Module, dict[int, nn.Parameter]]] = []
    try:
        for train, evaluation in zip(train_stages, eval_stages):
            if evaluation is train:  # one module serves both modes (eval_reuse.py): its own FSDP2 hooks gather
                continue
            sharded = {id(p): n for n, p in evaluation.named_parameters()}
            full = dict(train.named_parameters())
            swap = {pid: full[name] for pid, name in sharded.items() if name in full}
            originals = {id(full[name]): p for name, p in evaluation.named_parameters() if name in full}
            replace_parameters([evaluation], swap)
            lent.append((evaluation, originals))
        yield
    finally:
        for evaluation, originals in lent:
            replace_parameters([evaluation], originals)
        for unit in units:
            unit.reshard()


__all__ = ["apply_stage_fsdp", "unsharded_for_eval"]
