"""Lightning side: the one mesh-driven strategy and its registered presets."""

from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.registry import PRESETS, register_strategies, strategy_from_name

__all__ = ["PRESETS", "HybridParallelStrategy", "register_strategies", "strategy_from_name"]
