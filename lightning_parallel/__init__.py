"""lightning_parallel: Lightning strategies for data, ZeRO/FSDP2, tensor, pipeline, expert and 3D parallelism.

Importing the package registers the strategy names (``dp``, ``zero1``, ``zero2``, ``zero3``,
``fsdp2``, ``zero3_offload``, ``hsdp``, ``tp``, ``pp``, ``ep``) in Lightning's ``StrategyRegistry`` so that
``Trainer(strategy="zero3")`` works with an unchanged LightningModule.
"""

from lightning_parallel.parallel.allocator import advise_host_huge_pages

advise_host_huge_pages()  # first: torch reads it at its first CPU allocation, which importing Lightning makes

from lightning_parallel.parallel.dims import ParallelDims  # noqa: E402
from lightning_parallel.pretrained import PretrainedWeights, load_pretrained  # noqa: E402
from lightning_parallel.strategies import PRESETS, HybridParallelStrategy, register_strategies, strategy_from_name  # noqa: E402

__version__ = "0.1.0"

register_strategies()

__all__ = ["PRESETS", "HybridParallelStrategy", "ParallelDims", "PretrainedWeights", "__version__", "load_pretrained",
           "register_strategies", "strategy_from_name"]
