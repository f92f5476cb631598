"""One stage module for training and evaluation where both modes trace to the same computation.

The evaluation pipe is traced in eval mode because a model may compute differently there
(dropout, batch norm's running statistics, a Hugging Face branch on ``self.training``). Most
large models do not: a Llama or GPT config with zero dropout traces to graphs that differ only in
dropout calls that are the identity either way (``dropout(x, 0.0, True)`` against
``dropout(x, 0.0, False)``). Keeping a second copy of such a stage costs every pipeline rank its
graphs, generated code and tensor-parallel wrappers twice: measured on the 32-block GPT of
``benchmarks/bench_memory.py`` (4 ranks), 7 MiB of each ``pp`` rank's peak resident memory and
14 MiB of each ``3d`` rank's (issue 29). So where a stage's two traces compute the same function,
the evaluation pipe gets the training stage module itself; evaluation runs it under ``no_grad``,
where the blocks a training stage recomputes in backward run plainly
(:class:`~lightning_parallel.parallel.pipeline.trace.CheckpointedForward`).

The comparison is structural, node by node, after two normalisations that do not change what a
graph computes: an operator's arguments are named and their defaults filled in (``dropout_p=0.0``
of attention is the same as leaving it out), and a dropout that is the identity (probability 0,
or not training) is replaced by its input. Anything else that differs keeps the two stages apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe
from torch.fx.operator_schemas import normalize_function

_DROPOUTS = {
    torch.ops.aten.dropout.default,
    torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
}


def _is_identity_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _DROPOUTS or len(node.args) < 3:
        return False
    p, train = node.args[1], node.args[2]
    return isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train)


def _call_arguments(node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An operator call's arguments by name, every default filled in (``torch.fx``'s own normalisation), so
    that spelling a default out or leaving it away is the same call; other calls' arguments as they are."""
    if node.op == "call_function" and hasattr(node.target, "overloadpacket"):  # an ATen operator overload
        normalized = normalize_function(node.target, args, kwargs, normalize_to_only_use_kwargs=True)  # type: ignore[arg-type]
        if normalized is not None:
            return sorted(normalized.kwargs.items())
    return args, sorted(kwargs.items())


def graph_signature(graph: fx.Graph) -> str:
    """What ``graph`` computes, as text: each node's operation, target and normalised arguments, its
    inputs by position. Identity dropouts are skipped (their users read the dropout's input)."""
    alias: dict[fx.Node, fx.Node] = {}
    index: dict[fx.Node, int] = {}
    lines = []

    def ref(value: Any) -> Any:
        if isinstance(value, fx.Node):
            while value in alias:
                value = alias[value]
            return f"%{index[value]}"
        if isinstance(value, torch.Tensor):  # a constant: by its values (repr elides them), or unequal to anything
            small = not value.is_meta and value.numel() <= 4096
            return ("tensor", tuple(value.shape), str(value.dtype), value.tolist() if small else id(value))
        return value

    for node in graph.nodes:
        if _is_identity_dropout(node):
            alias[node] = node.args[0]  # type: ignore[assignment]
            continue
        args = fx.node.map_aggregate(node.args, ref)
        kwargs = fx.node.map_aggregate(node.kwargs, ref)
        index[node] = len(lines)
        lines.append(repr((node.op, str(node.target), _call_arguments(node, args, kwargs))))
    return "\n".join(lines)


def module_signature(module: nn.Module) -> list[tuple[str, str, str]]:
    """Every submodule's name, class and graph signature (empty for a module without a graph), and the
    module's tensor names: two modules with equal signatures run the same code on the same tensors."""
    subs = [(name, type(sub).__name__, graph_signature(sub.graph) if isinstance(getattr(sub, "graph", None), fx.Graph) else "")
            for name, sub in module.named_modules()]
    tensors = [(name, "tensor", "") for name, _ in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))]
    return subs + tensors


def share_equal_stages(train: Pipe, evaluation: Pipe, stages: Iterable[int] | None = None) -> list[int]:
    """Give ``evaluation`` the training stage module of every stage in ``stages`` (None: all) whose two traces
    compute the same; return those stage indices. Call it before anything else holds the evaluation stage modules."""
    shared = []
    for k in range(min(train.num_stages, evaluation.num_stages)) if stages is None else stages:
        mine, other = train.get_stage_module(k), evaluation.get_stage_module(k)
        if mine is not other and module_signature(mine) == module_signature(other):
            replace_stage_module(evaluation, k, mine)
            shared.append(k)
    return shared


def replace_stage_module(pipe: Pipe, index: int, module: nn.Module) -> None:
    """Make ``module`` stage ``index`` of ``pipe`` (the split module's child that torch names ``submod_pp_<index>``).

    The pipe's interpreter (``pipe.executor``, an ``fx.Interpreter`` over the split module) keeps its own
    table of the split module's submodules, taken when the pipe was made: refreshed here, or it would keep
    the replaced module alive (and, shipped from the tracing child, bring it along)."""
    current = pipe.get_stage_module(index)
    name = next(n for n, child in pipe.split_gm.named_children() if child is current)
    setattr(pipe.split_gm, name, module)
    executor = getattr(pipe, "executor", None)
    if isinstance(executor, fx.Interpreter):
        executor.submodules = dict(pipe.split_gm.named_modules())


def unique_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` without repeats, in order (a stage module serving both modes is changed once)."""
    return list(dict.fromkeys(modules))  # modules hash and compare by identity


__all__ = ["graph_signature", "module_signature", "replace_stage_module", "share_equal_stages", "unique_modules"]
