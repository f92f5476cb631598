"""``Trainer(sync_batchnorm=True)`` under the mesh strategy: honoured, or refused before any collective.

Lightning hands the flag to a strategy as ``strategy._layer_sync`` (a ``TorchSyncBatchNorm``
plugin, or the user's own ``LayerSync``); its DDP and FSDP strategies call ``apply`` on the
model, which swaps in ``torch.nn.SyncBatchNorm`` over the whole world. Here the statistics must
span the data-parallel ranks only (tensor and pipeline peers see the same samples), and torch's
module refuses CPU inputs, so the built-in plugin is replaced by
:func:`~lightning_parallel.parallel.data.sync_batchnorm.convert_sync_batchnorm` over the ``dp`` group;
a user's own plugin is applied as Lightning would.

Without the flag each data-parallel rank normalises with its own batch's statistics (as under
Lightning's DDP): such a model matches one process only up to that difference.

Unlike Lightning's DDP this does not revert the conversion at teardown: the module keeps its
layout for a later ``validate``/``test`` (see ``HybridParallelStrategy._parallelize``), and a
converted layer outside training, or with no process group, is a plain batch norm.
"""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch import nn

from lightning_parallel.errors import config_error
from lightning_parallel.parallel.dims import DP, ParallelDims
from lightning_parallel.parallel.data.sync_batchnorm import convert_sync_batchnorm, uses_batchnorm


def check_layer_sync(layer_sync: LayerSync | None, dims: ParallelDims, module: nn.Module | None) -> None:
    """Refuse layouts that cannot give batch norm the global batch's statistics (no collective).

    A model without BatchNorm has nothing to synchronise and passes under any layout.
    """
    if layer_sync is None or (module is not None and any(True for _ in module.parameters()) and not uses_batchnorm(module)):
        return
    if dims.pp > 1:
        raise config_error(
            ValueError, "Trainer(sync_batchnorm)", True,
            f"under pipeline parallelism (pipeline_parallel_size={dims.pp}) a BatchNorm layer normalises each"
            " microbatch on its own stage, never the global batch",
            "use a data-parallel strategy (dp, zero1-3, hsdp) for models with BatchNorm, or drop sync_batchnorm",
        )
    if dims.tp > 1 and dims.dp > 1:
        raise config_error(
            ValueError, "Trainer(sync_batchnorm)", True,
            f"synchronised BatchNorm is not supported with tensor parallelism (tensor_parallel_size={dims.tp})"
            f" and data parallelism (data_parallel_size={dims.dp}) together",
            "use a data-parallel strategy (dp, zero1-3, hsdp), or tensor_parallel_size alone (every rank then sees"
            " the whole batch and plain BatchNorm is already exact)",
        )


def apply_layer_sync(layer_sync: LayerSync | None, module: nn.Module, dims: ParallelDims) -> list[str]:
    """Convert ``module``'s BatchNorm layers in place; return the converted names.

    With one data-parallel rank every rank already sees the whole batch: nothing to convert.
    """
    if layer_sync is None or dims.dp == 1:
        return []
    if isinstance(layer_sync, TorchSyncBatchNorm):
        root, converted = convert_sync_batchnorm(module, dims.axis(DP).get_group())
        assert root is module  # a LightningModule is never itself a BatchNorm
        return converted
    layer_sync.apply(module)  # the user's own plugin, as Lightning's strategies call it
    return [type(layer_sync).__name__]

