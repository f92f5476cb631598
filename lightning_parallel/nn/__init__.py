"""Model building blocks that parallel strategies know how to handle (no Lightning import)."""

from lightning_parallel.nn.experts import DenseMLP, GroupedExperts
from lightning_parallel.nn.moe import (
    MoE,
    MoEStats,
    clear_moe_stats,
    collect_moe_losses,
    collect_moe_stats,
    set_moe_loss_coefs,
    set_moe_stats_group,
)
from lightning_parallel.nn.router import Routing, TopKRouter, drop_over_capacity, expert_capacity

__all__ = [
    "DenseMLP",
    "GroupedExperts",
    "MoE",
    "MoEStats",
    "Routing",
    "TopKRouter",
    "clear_moe_stats",
    "collect_moe_losses",
    "collect_moe_stats",
    "drop_over_capacity",
    "expert_capacity",
    "set_moe_loss_coefs",
    "set_moe_stats_group",
]
