"""Which values crossing a pipeline cut carry a gradient: a dependency analysis of the traced stages.

Why: torch's traced pipeline stages mark every floating tensor a stage receives as needing a
gradient, and send one back for it; the previous stage receives it and discards it. A Hugging Face
decoder hands each later stage the rotary ``cos`` and ``sin`` (made from a buffer and the
positions, under ``no_grad``): per microbatch and stage, two gradients computed for nothing, two
sends and receives for nothing, and under tensor parallelism one all-reduce per use of each (4 per
block on Llama, tp2 x pp2: the last stage sent 13 backward all-reduces per microbatch where the
Megatron minimum is 5).

So each rank reads its own stages' graphs (traced whole, never another rank's opaque blocks): an
output of a stage depends on a trainable parameter, or on some of the stage's inputs (union over
every op, which can only over-approximate: a value wrongly kept needs a gradient as before, one
wrongly dropped cannot happen). The ranks exchange these per-stage summaries with the cut they
already compare; every rank then resolves the same flags along the pipe's wiring, so a sender
waits for a gradient exactly when its receiver sends one (a mismatch would hang).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from torch import Tensor, fx, nn
from torch.distributed.pipelining import Pipe

Dep = tuple[frozenset[int], bool]  # (stage inputs it depends on, depends on a trainable parameter)
StageDeps = list[Dep]  # one per stage output, in the order the stage sends them
_NONE: Dep = (frozenset(), False)


def _union(values: Iterable[Any]) -> Dep:
    inputs: set[int] = set()
    param = False
    for value in values:
        for dep in _flat(value):
            inputs |= dep[0]
            param = param or dep[1]
    return frozenset(inputs), param


def _flat(value: Any) -> list[Dep]:
    if isinstance(value, list):
        return [d for v in value for d in _flat(v)]
    return [value] if value is not None else []


def _floating(node: fx.Node) -> bool:
    """False for a value the trace knows is not a floating tensor (indices, masks): it has no gradient."""
    val = node.meta.get("val")
    return not isinstance(val, Tensor) or val.is_floating_point()


def _trainable(module: nn.Module, target: str) -> bool:
    try:
        return module.get_parameter(target).requires_grad
    except AttributeError:  # a buffer or a constant
        return False


def _with_parameters(dep: Dep, module: nn.Module) -> Dep:
    """``dep``, depending on a parameter too if ``module`` holds a trainable one (a call not read op by op)."""
    return dep[0], dep[1] or any(p.requires_grad for p in module.parameters())


def _opaque(node: fx.Node) -> bool:
    """An op whose parameters the graph may not show (a custom op, a higher-order op): assume it has some."""
    namespace = getattr(node.target, "namespace", None)  # an OpOverload's library; "higher_order" for those ops
    return isinstance(namespace, str) and namespace not in ("aten", "prims")


def _run(module: nn.Module, inputs: list[Any]) -> tuple[dict[fx.Node, Any], fx.Node]:
    """Every node of ``module``'s graph as a :data:`Dep` (a list for a node holding several values), and its output node."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    for node in module.graph.nodes:  # type: ignore[union-attr]
        if node.op == "placeholder":
            env[node] = next(placeholders, _union(inputs))  # a missing input: anything the call passed
        elif node.op == "get_attr":
            env[node] = (frozenset(), _trainable(module, str(node.target)))
        elif node.op == "output":
            return env, node
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(env.get(node.args[0]), list):
            value = env[node.args[0]]
            env[node] = value[node.args[1]] if isinstance(node.args[1], int) and node.args[1] < len(value) else _union(value)
        elif node.op == "call_module" and not node.kwargs:
            env[node] = _module_values(module.get_submodule(str(node.target)), [env[a] if isinstance(a, fx.Node) else None for a in node.args])
        elif node.op == "call_module":  # keyword inputs: everything it reads, and its own parameters
            env[node] = _with_parameters(_union(env[a] for a in node.all_input_nodes), module.get_submodule(str(node.target)))
        elif node.op == "call_function" and _opaque(node):
            env[node] = _union(env[a] for a in node.all_input_nodes)[0], True
        else:
            env[node] = _union(env[a] for a in node.all_input_nodes)
        if not isinstance(env[node], list) and not _floating(node):
            env[node] = _NONE
    raise ValueError("a traced graph without an output node")


def _module_values(module: nn.Module, inputs: list[Any]) -> Any:
    """What ``module`` returns, as :data:`Dep` values shaped like its output (lists for tuples), given its inputs'."""
    if not isinstance(getattr(module, "graph", None), fx.Graph):  # a leaf module: its inputs and its own trainable parameters
        return _with_parameters(_union(inputs), module)
    env, output = _run(module, inputs)

    def shaped(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            return env[arg]
        if isinstance(arg, (tuple, list)):
            return [shaped(a) for a in arg]
        if isinstance(arg, dict):
            return [shaped(a) for a in arg.values()]
        return None

    return shaped(output.args[0])


def stage_dependencies(stage_module: nn.Module) -> StageDeps:
    """Per output of a traced stage, in the order torch sends them (``fx.node.map_aggregate`` over the
    output node's arguments, as ``pipelining._utils.flatten_args``): what it depends on."""
    count = sum(1 for n in stage_module.graph.nodes if n.op == "placeholder")  # type: ignore[union-attr]
    env, output = _run(stage_module, [(frozenset({i}), False) for i in range(count)])
    leaves: list[Any] = []
    fx.node.map_aggregate(output.args, lambda a: leaves.append(a))
    return [_union([env[a]]) if isinstance(a, fx.Node) else _NONE for a in leaves]


def input_sources(pipe: Pipe) -> list[list[tuple[int, int] | None]]:
    """For each stage of ``pipe`` in order, for each of its inputs: (the stage that sends it, the
    index of that stage's output), or None for a forward input of the whole model (or a constant)."""
    stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    index = {n: i for i, n in enumerate(stages)}

    def source(arg: Any) -> tuple[int, int] | None:
        if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem and arg.args[0] in index:
            return index[arg.args[0]], int(arg.args[1])  # type: ignore[arg-type]
        if isinstance(arg, fx.Node) and arg in index:
            return index[arg], 0
        return None

    return [[source(a) for a in node.args] for node in stages]


def resolve_cut_gradients(pipe: Pipe, deps: dict[int, StageDeps]) -> dict[int, tuple[list[bool], list[bool]]]:
    """Stage index -> (which inputs need a gradient, which outputs need one), along ``pipe``'s wiring.

    ``deps`` must hold every stage (each rank's own, exchanged). A stage input that is a forward
    input of the whole model never needs one (torch sends none back for it)."""
    result: dict[int, tuple[list[bool], list[bool]]] = {}
    for k, sources in enumerate(input_sources(pipe)):  # in graph order: a sender's flags are known before its receiver's
        needs_in = [src is not None and result[src[0]][1][src[1]] for src in sources]
        result[k] = (needs_in, [param or any(needs_in[i] for i in inputs if i < len(needs_in)) for inputs, param in deps[k]])
    return result


__all__ = ["StageDeps", "input_sources", "resolve_cut_gradients", "stage_dependencies"]
