"""How much of a model a tensor-parallel layout really splits, and the refusal when it is too little.

Why a refusal and not a warning: a plan that recognises almost nothing (a model declaring one
embedding as its whole ``base_model_tp_plan``, a state-space mixer, experts in a layout the plan
does not know) trains "successfully" while every rank holds and computes nearly the whole
model: tensor parallelism's memory and compute savings are gone, the run pays its collectives
anyway, and the only sign was a warning in a log. A layout that keeps more than
``1 - min_split`` of the parameters whole on every rank is therefore a typed error, raised from
the plan alone (no process group), unless the user lowers ``tensor_parallel_min_split``.

What counts as split: the parameters the plan shards over the tensor-parallel ranks, plus those
another model axis already divides so that no rank holds them whole (the experts modules under
expert parallelism). Everything else is whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.experts.apply import find_expert_modules
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan, fold_layer_index
from lightning_parallel.parallel.tensor.shards import owned_params, param_shard

DEFAULT_MIN_SPLIT = 0.5
"""Default ``tensor_parallel_min_split``: at least half of the parameters split (issue 26)."""


def _under(name: str, roots: set[str]) -> bool:
    return any(name == r or name.startswith(f"{r}.") for r in roots)


def whole_parameters(module: nn.Module, plan: TensorParallelPlan, split_elsewhere: Iterable[str] = ()) -> dict[str, int]:
    """Module FQN -> parameters (elements) it keeps whole on every tensor-parallel rank.

    ``split_elsewhere``: modules another axis divides (expert parallelism's experts modules)."""
    elsewhere = set(split_elsewhere)
    modules = dict(module.named_modules())
    whole: dict[str, int] = {}
    for mod_name, local, param in owned_params(module):
        if _under(mod_name, elsewhere) or (
            mod_name in plan.styles and param_shard(plan.styles, plan.packed, modules[mod_name], mod_name, local) is not None
        ):
            continue
        whole[mod_name] = whole.get(mod_name, 0) + param.numel()
    return whole


def split_share(module: nn.Module, plan: TensorParallelPlan, split_elsewhere: Iterable[str] = ()) -> float:
    """Fraction of the parameters (elements) that no tensor-parallel rank holds whole."""
    if not plan.total_params:
        return 1.0
    return 1.0 - sum(whole_parameters(module, plan, split_elsewhere).values()) / plan.total_params


def check_split_share(module: nn.Module, plan: TensorParallelPlan, min_split: float, ep_size: int = 1) -> float:
    """Raise a typed error when ``plan`` splits less than ``min_split`` of the parameters; return the share.

    With ``ep_size > 1`` the experts modules count as split (expert parallelism divides them). The
    message names the largest modules kept whole (layer indices folded) with the plan's reason for
    each, so the user sees what to put in a ``tp_plan``."""
    whole = whole_parameters(module, plan, find_expert_modules(module) if ep_size > 1 else ())
    share = 1.0 - sum(whole.values()) / plan.total_params if plan.total_params else 1.0
    if plan.tp_size <= 1 or share >= min_split:
        return share
    folded: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for name, count in whole.items():
        key = fold_layer_index(name)
        folded.setdefault(key, []).append(count)
        reasons.setdefault(key, plan.replicated.get(name, "kept whole"))
    largest = sorted(folded, key=lambda k: -sum(folded[k]))[:5]
    listed = "; ".join(
        f"`{k}`{f' x{len(folded[k])}' if len(folded[k]) > 1 else ''} ({100.0 * sum(folded[k]) / plan.total_params:.1f}%: {reasons[k]})"
        for k in largest
    )
    raise config_error(
        ValueError, "tensor_parallel_min_split", min_split,
        f"tensor parallelism (tp={plan.tp_size}, plan source: {plan.source}) splits only {100.0 * share:.1f}% of "
        f"{type(module).__name__}'s parameters, so every rank holds and computes the rest whole; "
        f"largest modules kept whole: {listed}",
        "give tp_plan={...} naming the projections to split, use a data-parallel strategy (zero3) for this model, "
        "or set tensor_parallel_min_split=0 to accept a partial split",
    )


__all__ = ["DEFAULT_MIN_SPLIT", "check_split_share", "split_share", "whole_parameters"]
