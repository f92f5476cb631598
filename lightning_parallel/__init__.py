"""lightning_parallel: Lightning strategies for data, ZeRO/FSDP2, tensor, pipeline, expert and 3D parallelism.

Importing the package registers the strategy names (``dp``, ``zero1`` ... ``3d``) in
Lightning's ``StrategyRegistry`` so that ``Trainer(strategy="zero3")`` works.
"""

__version__ = "0.1.0"
