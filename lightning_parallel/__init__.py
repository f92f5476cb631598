"""lightning_parallel: Lightning strategies for data, ZeRO/FSDP2, tensor, pipeline, expert and 3D parallelism.

Importing the package registers the strategy names (``dp``, ``zero1``, ``zero2``, ``zero3``,
``fsdp2``, ``zero3_offload``, ``hsdp``, ``tp``, ``pp``, ``ep``) in Lightning's ``StrategyRegistry`` so that
``Trainer(strategy="zero3")`` works with an unchanged LightningModule.
"""

from lightning_parallel._torchvision_compat import install_import_hook

install_import_hook()  # before anything imports lightning (see the module)

from lightning_parallel.parallel.dims import ParallelDims  # noqa: E402
from lightning_parallel.strategies import PRESETS, HybridParallelStrategy, register_strategies, strategy_from_name
from lightning_parallel.pretrained import PretrainedWeights, load_pretrained  # noqa: E402

__version__ = "0.1.0"

register_strategies()

__all__ = ["PRESETS", "HybridParallelStrategy", "ParallelDims", "PretrainedWeights", "__version__", "load_pretrained",
           "register_strategies", "strategy_from_name"]
