"""The strategy names users type: presets of the one ``HybridParallelStrategy``.

Every preset goes through the same class and code path, so a combination that works under one
name works under every other. No name shadows one of Lightning's built-ins (``ddp``, ``fsdp``,
``deepspeed`` ... keep meaning what Lightning says).
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.strategies.hybrid import HybridParallelStrategy

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp": ("Replicated data parallelism: torch DDP, bucketed all-reduce overlapped with backward", {"zero_stage": 0}),
    "zero1": ("ZeRO-1: DDP with optimizer state sharded across data-parallel ranks", {"zero_stage": 1}),
    "zero2": ("ZeRO-2 on FSDP2: params gathered once per step, gradients and optimizer state sharded", {"zero_stage": 2}),
    "zero3": ("ZeRO-3 on FSDP2: parameters, gradients and optimizer state sharded", {"zero_stage": 3}),
    "fsdp2": ("Alias of zero3 (FSDP2 fully_shard)", {"zero_stage": 3}),
    "zero3_offload": ("ZeRO-3 with sharded state offloaded to the CPU", {"zero_stage": 3, "cpu_offload": True}),
    "hsdp": (
        "Hybrid sharding: shard within a group (node), replicate across groups",
        {"zero_stage": 3, "hybrid_shard": True},
    ),
    "tp": (
        "Tensor parallelism (Megatron-style, DTensor) with an automatic plan; all devices by default",
        {"tensor_parallel_size": "auto"},
    ),
    "pp": (
        "Pipeline parallelism of an unchanged LightningModule: stages found automatically, 1F1B by default;"
        " all devices by default",
        {"pipeline_parallel_size": "auto"},
    ),
    "3d": (
        "3D parallelism: data x tensor x pipeline (x expert for MoE models) on one mesh; 'auto' degrees are the"
        " layout planner's fastest fitting layout with the most model-parallel axes; rank 0 logs the choice,"
        " the runner-up and the rejected layouts",
        {"data_parallel_size": "auto", "tensor_parallel_size": "auto", "pipeline_parallel_size": "auto",
         "expert_parallel_size": "auto"},
    ),
    "cp": (
        "Context parallelism: every sequence split over the ranks (head-tail balanced), attention across the"
        " chunks by all-gather or ring; Hugging Face models; all devices by default",
        {"context_parallel_size": "auto"},
    ),
    "ep": (
        "Expert parallelism: MoE experts split over the data-parallel ranks, tokens moved by all-to-all",
        {"expert_parallel_size": "auto"},
    ),
}


def register_strategies(registry: Any = StrategyRegistry) -> list[str]:
    """Register every preset not yet registered; return the names registered by this call."""
    added = []
    for name, (description, params) in PRESETS.items():
        if name in registry:
            continue
        registry.register(name, HybridParallelStrategy, description=description, **params)
        added.append(name)
    return added


def strategy_from_name(name: str, **overrides: Any) -> HybridParallelStrategy:
    """Build a preset by name with option overrides (the Hydra app and the CLI use this).

    Lightning's own message for an unknown name lists only its built-ins; this one lists ours
    and the closest matches.
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.5)
        raise config_error(
            ValueError,
            "strategy",
            name,
            f"lightning_parallel strategies are {sorted(PRESETS)}",
            f"did you mean {close[0]!r}?" if close else "pick one of those names, or a Lightning built-in such as 'ddp'",
        )
    return HybridParallelStrategy(**{**PRESETS[name][1], **overrides})
