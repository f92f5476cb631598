"""Tensor parallelism inside pipeline stages (tp x pp): DTensor parameters in the traced graphs.

Why not :func:`~lightning_parallel.parallel.tensor.apply.apply_tensor_parallel` first and
then the pipeline split: the split traces ``forward`` with ``torch.export``, which rejects
DTensor parameters. So the order is the documented one, pipeline split -> tensor parallel, and
tensor parallelism is applied to what the split produced: each stage's traced graph.

A traced graph no longer has ``nn.Linear`` modules to wrap with ``ColwiseParallel``; it has
aten ops on parameters that keep their original names. So the plan (module -> style, from
:mod:`~lightning_parallel.parallel.tensor.plan`, the same one ``tp`` uses) becomes a placement per
parameter, the one eager ``tp`` gives it (column-parallel weight and bias: ``Shard(0)``, a
``Conv1D``'s transposed weight ``Shard(1)``, a packed ``[q | k | v]`` / ``[gate | up]`` output
``_StridedShard``; row-parallel weight: ``Shard(1)``; vocabulary-parallel embedding:
``Shard(0)``), every such parameter becomes a DTensor on the
tensor-parallel mesh, and the stage graph runs as it was traced, in DTensor's global
semantics: a column-parallel matmul yields a feature-sharded activation, the traced reshapes
with the global head count stay sharded along the heads, the row-parallel matmul yields a
``Partial`` sum that is all-reduced where a replicated value is needed (Megatron's pattern,
found by DTensor's sharding propagation instead of being written down). Plain tensors the graph
meets (the stage inputs, a replicated norm weight, masks) join as replicated DTensors (see
:class:`~lightning_parallel.parallel.tensor.attention.ReplicateMixedMode`); on CPU attention uses
the math kernel, which DTensor can shard. A stage's outputs leave as full plain tensors, so
what crosses a pipeline cut (and what the loss sees) is exactly what a single process computes,
except values split over the tp ranks, which cross as their shards from the second training step on
(:mod:`~lightning_parallel.parallel.pipeline.shard_crossing`).

One rewrite of the graphs: ``torch.export`` drops a ``.contiguous()`` that was a no-op for the
kernel seen while tracing (``y.transpose(1, 2).contiguous().view(B, T, C)`` after the CPU flash
attention), so the graph's ``view`` then fails on the math kernel's strides. Every traced
``aten.view`` becomes ``aten.reshape``: the same values, a copy only where a view is impossible.

The new parameters are new objects: :func:`swap_optimizer_parameters` points optimizers built
before (Lightning builds them in ``setup``, the stages are traced from the first batch) at them,
distributing any state they already hold (a restored checkpoint) the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import Optimizer

from lightning_parallel.compat import AsyncCollectiveTensor, assert_tensor_metadata_op, tree_flatten, tree_map, tree_unflatten
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.shard_crossing import crossing_inputs, embed_shard, split_dim
from lightning_parallel.parallel.tensor.apply import _grad_to_param_layout
from lightning_parallel.parallel.tensor.attention import ReplicateMixedMode, full_value
from lightning_parallel.parallel.tensor.rank_order import RankOrder, mark, mark_states, stored_whole
from lightning_parallel.parallel.tensor.fused import packed_placement
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan
from lightning_parallel.parallel.tensor.shards import plan_param_shard
from lightning_parallel.parallel.tensor.styles import COLWISE, COLWISE_GATHER, PACKED_COLWISE, ROWWISE, ROWWISE_SPLIT_INPUT


def parameter_placements(module: nn.Module, plan: TensorParallelPlan) -> dict[str, list[Placement]]:
    """Canonical parameter FQN -> its placements on the tensor-parallel mesh, for every sharded parameter.

    A parameter tied between two planned modules must get one placement from both.
    """
    canonical = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, list[Placement]] = {}
    for mod_name, style in plan.styles.items():
        for local, param in module.get_submodule(mod_name).named_parameters(recurse=False):
            # The same (dim, parts) as eager tensor parallelism: Conv1D's transposed weight, and
            # _StridedShard for a packed output ([q | k | v], [gate | up]) so each rank holds its
            # slice of every part and the traced head reshapes stay local.
            shard = plan_param_shard(plan, module, mod_name, local)
            if shard is None:
                continue
            name = canonical[id(param)]
            placement: list[Placement] = [packed_placement(shard[0], shard[1], param.ndim, plan.packed_biases_split)]
            if name in out and out[name] != placement:
                raise config_error(
                    ValueError, "tp_plan", f"{mod_name}: {style}",
                    f"parameter `{name}` is shared by modules the plan splits along different dims ({out[name]} and {placement})",
                    "give tied modules styles that split the tied weight the same way (e.g. embedding_rowwise with colwise_gather_output)",
                )
            out[name] = placement
    return out


class TensorParallelStageForward:
    """Replaces a stage module's ``forward``: run the traced graph in DTensor semantics, return plain tensors.

    An object rather than a closure so that the wrapped module stays picklable and inspectable.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, column_weights: Iterable[int] = ()) -> None:
        # The module, not its bound ``forward``: ``GraphModule.recompile`` (the lean code of
        # ``finalize_code``, the passes below) installs a new ``forward`` on the class, and a method
        # bound now would keep running the code traced before them.
        self.module = module
        self.mesh = mesh
        self.force_math = mesh.device_type == "cpu"  # no DTensor rule for the CPU flash kernel
        self.column_weights = set(column_weights)
        # Values crossing a cut as shards (shard_crossing.py): flat output index -> split dim seen in
        # training; then, once the stages agreed, the outputs sent and the positional inputs read so.
        self.split_outputs_seen: dict[int, int] = {}
        self.shard_outputs: dict[int, int] = {}
        self.shard_inputs: dict[int, int] = {}

    def after_inlining(self, module: nn.Module) -> int:
        """What needs the stage's submodule calls inlined (one graph, where q, k and v meet their
        shared input): one input-gradient reduction per group of column-parallel matmuls."""
        return reduce_column_input_gradients(module, self.column_weights)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_settled, (args, kwargs))
        args = crossing_inputs(args, self.shard_inputs, self.mesh)
        with contextlib.ExitStack() as stack:
            stack.enter_context(ReplicateMixedMode())
            stack.enter_context(implicit_replication())
            if self.force_math:
                stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            out = type(self.module).forward(self.module, *args, **kwargs)
        return self._leaving(out)

    def _leaving(self, out: Any) -> Any:
        """The outputs as whole plain tensors, but those agreed to cross as shards (training only)."""
        flat, spec = tree_flatten(out)
        training = torch.is_grad_enabled()
        leaving = []
        for i, value in enumerate(flat):
            dim = split_dim(value, self.mesh) if training else None
            if dim is not None:
                self.split_outputs_seen[i] = dim
            if training and i in self.shard_outputs:
                if dim != self.shard_outputs[i]:  # the receiver would read a wrong slice: never silently
                    raise RuntimeError(f"stage output {i} was agreed to cross split on dim {self.shard_outputs[i]}, now {dim}")
                leaving.append(_settled(embed_shard(value, dim)))
            else:
                leaving.append(_settled(full_value(value)))
        return tree_unflatten(leaving, spec)


class _Settle(torch.autograd.Function):
    """Identity whose output, and whose gradient, are finished tensors.

    DTensor collectives return ``AsyncCollectiveTensor`` wrappers that wait on first use by an
    op. What crosses a cut goes to the pipeline's point-to-point sends and receive buffers,
    which are not ops on the wrapper; finishing the collective here, before that, is a
    precaution that costs nothing: a stage output (forward) and the gradient of a stage input
    (backward) are always finished tensors.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return _wait(x).view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return _wait(grad)


def _wait(x: Tensor) -> Tensor:
    return x.wait() if isinstance(x, AsyncCollectiveTensor) else x


def _settled(value: Any) -> Any:
    if isinstance(value, Tensor) and not isinstance(value, DTensor):
        return _Settle.apply(value) if value.requires_grad else _wait(value)
    return value


def local_part(tensor: Tensor) -> Tensor:
    """What this rank stores of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def retarget_calls(module: nn.Module, targets: dict[Any, Any]) -> int:
    """In every traced graph under ``module``, make each ``call_function`` of a key of ``targets``
    call its value instead (same arguments); recompile what changed and return the count."""
    changed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        count = 0
        for node in graph.nodes:
            if node.op == "call_function" and node.target in targets:
                node.target = targets[node.target]
                count += 1
        if count:
            _recompile(sub)
        changed += count
    return changed


def _recompile(sub: nn.Module) -> None:
    if isinstance(sub, fx.GraphModule):
        sub.recompile()
    elif callable(getattr(sub, "finalize", None)):  # torch.export's InterpreterModule
        sub.finalize()


def drop_metadata_asserts(module: nn.Module) -> int:
    """Remove the ``aten._assert_tensor_metadata`` checks ``torch.export`` records for ``.to(dtype)``
    calls (Hugging Face norms and rotary embeddings); return how many.

    Why: they check what the trace already fixed and return nothing, and DTensor has no sharding
    rule for them, so a tensor-parallel stage would fail on the first one.
    """
    dropped = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        asserts = [n for n in graph.nodes if n.op == "call_function" and n.target is assert_tensor_metadata_op() and not n.users]
        for node in asserts:
            graph.erase_node(node)
        if asserts:
            _recompile(sub)
        dropped += len(asserts)
    return dropped


def _reduced(x: Any) -> Any:
    """A pending (``Partial``) DTensor reduced to replicated; anything else as it is."""
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        replicate = [Replicate()] * x.device_mesh.ndim
        # Through a local tensor: the gradient arriving here may itself be a pending sum, which
        # redistribute's backward cannot turn into the embedding's masked partial; from_local's
        # backward first makes it replicated, as a module's output hook does in eager tensor parallelism.
        return DTensor.from_local(x.redistribute(x.device_mesh, replicate).to_local(), x.device_mesh, replicate, run_check=False)
    return x


def reduce_embedding_outputs(module: nn.Module) -> int:
    """Reduce every traced ``aten.embedding`` output right where it is computed; return how many.

    Why: a vocabulary-parallel embedding yields a masked partial sum whose mask lives only until
    the next op; ``ColwiseParallel``/``RowwiseParallel`` modules reduce it in their output hook,
    but a traced graph has no hooks, and a Hugging Face model's next op (``.to(float32)`` in the
    first norm) would carry the partial on without its mask. Replicated embeddings pass unchanged.
    """
    return _reduce_after(module, lambda sub, graph: [
        n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default])


def _each_graph(module: nn.Module, rewrite: Any) -> int:
    """Call ``rewrite(sub, graph)`` (returning how many changes it made) on every traced graph under
    ``module``; recompile what changed and return the total."""
    changed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            count = rewrite(sub, graph)
            if count:
                _recompile(sub)
            changed += count
    return changed


def _reduce_after(module: nn.Module, select: Any) -> int:
    """In every traced graph under ``module``, pass each node ``select(sub, graph)`` returns through
    :func:`_reduced` before its users see it; recompile what changed and return the count."""
    def rewrite(sub: nn.Module, graph: fx.Graph) -> int:
        nodes = select(sub, graph)
        for node in nodes:
            with graph.inserting_after(node):
                reduced = graph.call_function(_reduced, (node,))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user, r=reduced: user is not r)
        return len(nodes)

    return _each_graph(module, rewrite)


_WEIGHT_VIEWS = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def reduce_row_outputs(module: nn.Module, row_weights: set[int]) -> int:
    """Reduce each row-parallel matmul's output right where it is computed; return how many.

    Why: eager tensor parallelism all-reduces a row-parallel layer's output in its module hook
    (Megatron's one reduction per region). A traced graph has no hooks, and DTensor's
    propagation left alone carries the pending sum on into the residual add, the next norm and
    the next projections, where each op that cannot take a ``Partial`` input redistributes its
    own way (measured on HF Llama, tp2 x pp2: 9-10 all-gathers per stage forward, 6-8x the
    minimum). ``row_weights``: ids of the row-parallel weight parameters.
    """
    return _reduce_after(module, lambda sub, graph: _weight_users(sub, graph, row_weights))


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.reshape)  # the last after use_python_bindings


def _gradient_reduced(x: Any, weight: Any) -> Any:
    """``x`` as a replicated DTensor whose gradient leaves here replicated (reduced once); anything else as it is.

    ``from_local``'s backward redistributes the gradient to the placements given (replicated), so a
    pending sum arriving from the column-parallel matmuls is all-reduced once, here. A plain tensor
    (the stage's input, or a norm computed on it before any DTensor) joins on ``weight``'s mesh:
    left to each matmul, it would join once per projection, each with its own reduction."""
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            return x
        return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False)
    if not (isinstance(x, Tensor) and isinstance(weight, DTensor) and x.is_floating_point()):
        return x  # a weight kept whole (not this rank's, or not split): nothing to reduce
    mesh = weight.device_mesh
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def reduce_column_input_gradients(module: nn.Module, column_weights: set[int]) -> int:
    """Reduce the input gradient of each group of column-parallel matmuls where their input is made; return how many.

    Why: a column-parallel matmul's input gradient is a pending (``Partial``) sum. Eager tensor
    parallelism reduces it once at the region's input (q, k and v, or gate and up, share one
    input: their gradients are summed first, Megatron's one backward all-reduce per region).
    In a traced stage DTensor's propagation carries the pending gradient on through the norm
    before the region, whose weight gradient then needs an all-reduce of its own (measured on HF
    Llama, tp2 x pp2: 4 backward all-reduces per block where the minimum is 2). Reduced here, the
    norm, the residual and the previous region's output see a replicated gradient.
    ``column_weights``: ids of the column-parallel weight parameters. Matmuls that read their input
    through views of one node (``view(h)`` per projection) share the reduction at that node.
    """
    def select(sub: nn.Module, graph: fx.Graph) -> list[tuple[fx.Node, set[fx.Node], fx.Node]]:
        inputs: dict[fx.Node, tuple[set[fx.Node], fx.Node]] = {}
        for matmul in _weight_users(sub, graph, column_weights):
            weight = next(a for a in matmul.all_input_nodes if a.op == "get_attr" or a.target in _WEIGHT_VIEWS)
            while weight.op != "get_attr":
                weight = weight.all_input_nodes[0]
            for arg in matmul.args:
                if not isinstance(arg, fx.Node) or arg.op == "get_attr" or arg.target in _WEIGHT_VIEWS:
                    continue
                reader = matmul
                while arg.op == "call_function" and arg.target in _VIEWS and len(arg.users) == 1:
                    arg, reader = arg.args[0], arg  # type: ignore[assignment]
                inputs.setdefault(arg, (set(), weight))[0].add(reader)
                break
        return [(node, readers, weight) for node, (readers, weight) in inputs.items()]

    def rewrite(sub: nn.Module, graph: fx.Graph) -> int:
        groups = select(sub, graph)
        order = {node: i for i, node in enumerate(graph.nodes)}
        for node, readers, weight in groups:
            # Before the first reader (the input may be a placeholder), with the weight read again there for its mesh.
            with graph.inserting_before(min(readers, key=order.__getitem__)):
                mesh_of = graph.get_attr(weight.target)
                reduced = graph.call_function(_gradient_reduced, (node, mesh_of))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user, r=readers: user in r)
        return len(groups)

    return _each_graph(module, rewrite)


def _weight_users(sub: nn.Module, graph: fx.Graph, weights: set[int]) -> list[fx.Node]:
    """The ops of ``graph`` that read one of ``weights`` (by id), directly or through a transpose."""
    matmuls: list[fx.Node] = []
    for node in graph.nodes:
        if node.op != "get_attr" or id(_fetch(sub, node.target)) not in weights:
            continue
        users = list(node.users)
        while len(users) == 1 and users[0].op == "call_function" and users[0].target in _WEIGHT_VIEWS:
            users = list(users[0].users)
        matmuls += [u for u in users if u.op == "call_function" and u not in matmuls]
    return matmuls


def _fetch(root: nn.Module, target: Any) -> Any:
    value: Any = root
    for part in str(target).split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def views_to_reshapes(module: nn.Module) -> int:
    """Turn every ``aten.view`` of the traced graphs under ``module`` into ``aten.reshape``; return how many."""
    return retarget_calls(module, {torch.ops.aten.view.default: torch.ops.aten.reshape.default})


def replace_parameters(roots: Iterable[nn.Module], replaced: dict[int, nn.Parameter]) -> None:
    """Register ``replaced[id(old)]`` wherever ``old`` is registered under ``roots`` (same names, ties kept)."""
    for root in roots:
        for sub in root.modules():
            for key, tensor in list(sub._parameters.items()):
                if tensor is not None and id(tensor) in replaced:
                    sub._parameters[key] = replaced[id(tensor)]


def apply_stage_tensor_parallel(
    module: nn.Module,
    stage_modules: Iterable[nn.Module],
    owned: set[str],
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan,
) -> dict[nn.Parameter, nn.Parameter]:
    """Shard this rank's stage parameters over ``tp_mesh`` by ``plan``; return old -> new parameter.

    ``owned``: the canonical FQNs the local stages use (the rest were released and stay as they
    are). Every tensor-parallel peer holds the same full values (same seed or same checkpoint),
    so each keeps its slice without communicating. The new parameters replace the old ones
    under the same names in ``module`` and in every stage module.
    """
    if tp_mesh.ndim != 1 or tp_mesh.size() != plan.tp_size:
        raise config_error(
            ValueError, "tp_mesh", tp_mesh, f"must be a 1-D mesh of plan.tp_size={plan.tp_size} ranks", "pass ParallelDims.axis(TP)"
        )
    stage_modules = list(stage_modules)
    placements = parameter_placements(module, plan)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if name not in owned or name not in placements:
            continue
        owner = name.rpartition(".")[0]
        order = RankOrder(0, plan.packed_sizes[owner], tp_mesh.size()) if owner in plan.packed_sizes else None
        whole = param.detach() if order is None else order.stored(param.detach())
        local = distribute_tensor(whole, tp_mesh, placements[name], src_data_rank=None)
        new = nn.Parameter(local, requires_grad=param.requires_grad)
        if order is not None:  # unequal packed parts (Phi-3's qkv_proj): stored in rank order (rank_order.py)
            mark(new, order)
        if new.requires_grad:
            new.register_post_accumulate_grad_hook(_grad_to_param_layout)
        replaced[id(param)] = (param, new)
    replace_parameters([module, *stage_modules], {key: new for key, (_, new) in replaced.items()})
    rows = {n for n, s in plan.styles.items() if s in (ROWWISE, ROWWISE_SPLIT_INPUT)}
    row_weights = {id(p) for n, p in module.named_parameters() if n.rpartition(".")[0] in rows and n.endswith("weight")}
    columns = {n for n, s in plan.styles.items() if s in (COLWISE, COLWISE_GATHER, PACKED_COLWISE)}
    column_weights = {id(p) for n, p in module.named_parameters() if n.rpartition(".")[0] in columns and n.endswith("weight")}
    for stage_module in stage_modules:
        if not isinstance(stage_module.__dict__.get("forward"), TensorParallelStageForward):
            views_to_reshapes(stage_module)
            drop_metadata_asserts(stage_module)
            reduce_embedding_outputs(stage_module)
            reduce_row_outputs(stage_module, row_weights)
            stage_module.forward = TensorParallelStageForward(stage_module, tp_mesh, column_weights)  # type: ignore[method-assign]
    return dict(replaced.values())


@torch.no_grad()
def swap_optimizer_parameters(optimizers: Iterable[Optimizer], mapping: dict[nn.Parameter, nn.Parameter]) -> None:
    """Point ``optimizers`` at the new parameters; state tensors shaped like the parameter follow its layout."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]
        for old, new in mapping.items():
            if old not in optimizer.state:
                continue
            state = mark_states(old, optimizer.state.pop(old))  # a rank-ordered parameter's (rank_order.py)
            for key, value in state.items():
                if isinstance(value, Tensor) and isinstance(new, DTensor) and value.shape == old.shape and value.dim() > 0:
                    # Already laid out (tensor-parallel state meeting ZeRO's new parameters): from the whole value,
                    # in the model's order, then in the new parameter's (stored in rank order, it needs that too).
                    whole = full_value(value) if isinstance(value, DTensor) else value
                    state[key] = distribute_tensor(stored_whole(new, whole), new.device_mesh, new.placements, src_data_rank=None)
            optimizer.state[new] = state


__all__ = [
    "TensorParallelStageForward",
    "apply_stage_tensor_parallel",
    "full_value",
    "local_part",
    "parameter_placements",
    "replace_parameters",
    "retarget_calls",
    "swap_optimizer_parameters",
    "views_to_reshapes",
    "drop_metadata_asserts",
]
