"""Leaner code for traced pipeline stages: submodule calls inlined, aten ops through torch's own bindings.

Why: a stage cut from a ``torch.export`` trace keeps the model's module hierarchy (that is how
parameter names stay those of the LightningModule): ``torch.export.unflatten`` rebuilds every
submodule as an ``InterpreterModule`` whose generated code calls its children, down to each
``nn.Linear``, and calls every operator as ``torch.ops.aten.<op>.<overload>``. Both cost Python
time a hand-written stage does not pay: a module call goes through ``nn.Module.__call__`` and the
``InterpreterModule`` wrapper, and an ``OpOverload`` call parses its arguments against the schema
in the JIT's generic path instead of the generated Python bindings (measured here on the 2-core
CPU: ``torch.ops.aten.view.default`` 12.6 us against ``Tensor.view`` 7.1 us). On the GPT of
``benchmarks/bench_pipeline_vs_manual.py`` (4 blocks of width 128 per stage) the traced forward
of a microbatch took 1.08x the hand-written stage's (paired median of 250 alternating runs), the
backward 0.99x. On a GPU, where kernels are short and Python launches them, the same overhead
weighs more.

So, once tensor and expert parallelism have changed the stages (:meth:`PipelineRuntime.finalize_code`:
the pipeline driver calls it before ZeRO wraps the stages, a bare runtime at its first step):

* :func:`inline_submodule_calls`: every call of a plain ``InterpreterModule`` child is replaced by
  the child's graph, its attribute reads prefixed with the child's path, so a stage runs one
  generated function. Parameters are still read through the hierarchy at each call
  (``self.blocks[0].attn.q.weight``), so names, ownership, FSDP2's parameter swaps and checkpoints
  are unchanged. A child stays a call when anything else may happen at its call: forward hooks
  (tensor parallelism's input and output redistributions, FSDP2), a patched ``forward`` (activation
  checkpointing), or a class that is not a traced ``InterpreterModule``.
* :func:`use_python_bindings`: calls of the operators in :data:`BINDINGS` go to the function torch's
  Python API exposes for the same operator with the same argument order (``aten.linear.default`` ->
  ``F.linear``, ``aten.view.default`` -> ``Tensor.view``, ...): the same ATen kernel,
  autograd node and dispatch (DTensor, autocast) for less argument parsing. ``aten.linear`` goes to
  :func:`~.grad_accumulation.accumulating_linear`: ``F.linear`` itself, except inside a pipeline
  schedule's training step, where each microbatch's weight gradient is added into ``.grad`` by its
  GEMM instead of through a temporary.

Values are unchanged; the graph's semantics are the same ops in the same order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.fsdp import FSDPModule
from torch.export.unflatten import InterpreterModule

from lightning_parallel.compat import global_module_hooks, module_has_hooks
from lightning_parallel.parallel.pipeline.grad_accumulation import accumulating_linear

_ATEN = torch.ops.aten

#: aten overload -> the Python binding of the same operator taking the same arguments in the same
#: order (checked by ``tests/test_pipeline_codegen.py`` against each overload's schema).
BINDINGS: dict[Any, Callable[..., Any]] = {
    _ATEN.linear.default: accumulating_linear,  # F.linear outside a schedule's training step
    _ATEN.view.default: torch.Tensor.view,
    _ATEN.reshape.default: torch.reshape,
    _ATEN.transpose.int: torch.transpose,
    _ATEN.permute.default: torch.permute,
    _ATEN.add.Tensor: torch.add,
    _ATEN.sub.Tensor: torch.sub,
    _ATEN.mul.Tensor: torch.mul,
    _ATEN.div.Tensor: torch.div,
    _ATEN.layer_norm.default: torch.layer_norm,
    _ATEN.embedding.default: torch.embedding,
    _ATEN.dropout.default: torch.dropout,
    _ATEN.gelu.default: F.gelu,
    _ATEN.silu.default: F.silu,
    _ATEN.relu.default: torch.relu,
    _ATEN.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    _ATEN.matmul.default: torch.matmul,
    _ATEN.cat.default: torch.cat,
    _ATEN.contiguous.default: torch.Tensor.contiguous,
    _ATEN.unsqueeze.default: torch.unsqueeze,
}


def _graph_owner(module: nn.Module) -> bool:
    """A traced module whose forward runs its own graph's generated code: a stage's ``GraphModule``
    (the pipeline split's submodule), or an ``InterpreterModule`` / ``UnflattenedModule`` of
    ``torch.export.unflatten`` (their ``finalize`` regenerates the code). Not a module FSDP2 has
    wrapped already: its class is then FSDP2's subclass, on which ``GraphModule.recompile``
    installs a call wrapper that calls itself (the driver makes the code lean before ZeRO)."""
    if isinstance(module, FSDPModule):
        return False
    return isinstance(module, fx.GraphModule) or (
        isinstance(getattr(module, "graph", None), fx.Graph) and hasattr(module, "finalize") and hasattr(module, "graph_module")
    )


def _regenerate(module: nn.Module) -> None:
    if isinstance(module, fx.GraphModule):
        module.recompile()
    else:
        module.finalize()


def _inlinable(child: nn.Module) -> bool:
    """A child whose call does nothing but run its graph: no hooks, no patched forward."""
    return (
        type(child) is InterpreterModule
        and child.graph_module is not None
        and "forward" not in child.__dict__
        and not module_has_hooks(child)
    )


def _bind_inputs(call: fx.Node, placeholders: list[fx.Node]) -> dict[fx.Node, Any] | None:
    """The child's placeholders bound to the call's arguments, or None if the call cannot be mapped."""
    if len(call.args) > len(placeholders):
        return None
    env: dict[fx.Node, Any] = dict(zip(placeholders, call.args))
    kwargs = dict(call.kwargs)
    for ph in placeholders[len(call.args):]:
        if ph.target in kwargs:
            env[ph] = kwargs.pop(ph.target)
        elif ph.args:  # a default
            env[ph] = ph.args[0]
        else:
            return None
    return env if not kwargs else None


def _inline_call(graph: fx.Graph, call: fx.Node, child: nn.Module) -> bool:
    """Replace ``call`` (of ``child``, a direct or dotted child of the graph's module) by the child's nodes."""
    placeholders = [n for n in child.graph.nodes if n.op == "placeholder"]
    env = _bind_inputs(call, placeholders)
    if env is None:
        return False
    output = next(n for n in child.graph.nodes if n.op == "output").args[0]
    if not isinstance(output, fx.Node) and any(
        user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int)
        for user in call.users
    ):
        return False  # a structured result used other than by indexing: keep the call
    prefix = str(call.target)
    with graph.inserting_before(call):
        for node in child.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            if node.op in ("get_attr", "call_module"):
                new = graph.create_node(node.op, f"{prefix}.{node.target}", args, kwargs, name=node.name)
            else:
                new = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
            new.meta = dict(node.meta)
            env[node] = new
    result = fx.node.map_arg(output, lambda n: env[n])
    if isinstance(result, fx.Node):
        call.replace_all_uses_with(result)
    else:
        for user in list(call.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(call)
    return True


def inline_submodule_calls(module: nn.Module) -> int:
    """Inline the calls of plain traced children into ``module``'s graph (see the module doc), in
    place, then regenerate its code; return the number of calls inlined."""
    if not _graph_owner(module) or global_module_hooks():
        return 0
    graph: fx.Graph = module.graph
    inlined = 0
    progress = True
    while progress:
        progress = False
        for node in list(graph.nodes):
            if node.op != "call_module":
                continue
            child = module.get_submodule(str(node.target))
            if _inlinable(child) and _inline_call(graph, node, child):
                inlined += 1
                progress = True
    if inlined:
        _regenerate(module)
    return inlined


def use_python_bindings(module: nn.Module) -> int:
    """Point the graph's calls of :data:`BINDINGS` operators at their Python bindings; regenerate the
    code; return the number of calls changed."""
    if not _graph_owner(module):
        return 0
    changed = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in BINDINGS:
            node.target = BINDINGS[node.target]
            changed += 1
    if changed:
        _regenerate(module)
    return changed


def lean_stage_code(stages: Iterable[nn.Module]) -> tuple[int, int]:
    """:func:`inline_submodule_calls` and :func:`use_python_bindings` on the traced modules of
    ``stages`` that still run once their callers are lean; returns (calls inlined, operator calls
    rebound).

    Top-down from each stage: a module's calls are inlined first, then the children its graph still
    calls (one kept as a call, e.g. a checkpointed block) are made lean in turn. A child whose every
    call was inlined never runs again, so its own graph is left as it is: inlining into it too would
    build a second copy of every block's graph that nothing runs (on a ``3d`` rank of the 32-block
    GPT of ``benchmarks/bench_memory.py`` that copy was resident memory at the training peak). A
    module that is not a traced graph (a forward of the user's, FSDP2's wrapper) may run any child:
    all of them are visited."""
    seen: set[int] = set()

    def lean(module: nn.Module) -> tuple[int, int]:
        if id(module) in seen:
            return 0, 0
        seen.add(id(module))
        if _graph_owner(module):
            own = (inline_submodule_calls(module), use_python_bindings(module))
            called = [module.get_submodule(str(n.target)) for n in module.graph.nodes if n.op == "call_module"]
        else:
            own, called = (0, 0), list(module.children())
        below = [lean(child) for child in called]
        return own[0] + sum(i for i, _ in below), own[1] + sum(r for _, r in below)

    totals = [lean(stage) for stage in stages]
    return sum(i for i, _ in totals), sum(r for _, r in totals)


__all__ = ["BINDINGS", "inline_submodule_calls", "lean_stage_code", "use_python_bindings"]
