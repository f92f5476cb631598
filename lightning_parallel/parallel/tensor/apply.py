"""Megatron-style tensor parallelism on DTensor for an unchanged model, in place.

Given a :class:`~lightning_parallel.parallel.tensor.plan.TensorParallelPlan` (see :mod:`lightning_parallel.parallel.tensor.plan`),
the first linear(s) of each pair split their output features (column-parallel), the second
its input features (row-parallel, one all-reduce per pair in the forward), the token embedding
its vocabulary, and the LM head its vocabulary with the logits gathered, so the model's own
``forward`` and an unchanged ``F.cross_entropy`` on the logits still work. Parameter names
never change (``parallelize_module`` swaps each parameter for a DTensor under the same name),
so optimizers built afterwards, ``state_dict`` and distributed checkpoints see the same keys.

Inside an attention or MLP module (a "region": the parent of a row-parallel linear) the
column-parallel outputs stay DTensors, which is what lets code that reshapes with the global
head count run unchanged (see :mod:`lightning_parallel.parallel.tensor.attention`). What leaves a
region or a sharded module outside one is a plain tensor, never the ``AsyncCollectiveTensor`` of
a pending all-reduce (``tp_attention.settled``: AOT autograd mishandles it as the input of a
compiled block, ``compile_blocks``).

Sequence parallelism (``sequence_parallel=True``): between blocks the residual stream stays
split along the sequence (dim 1, batch-first): norms run on their slice with replicated
DTensor weights (``SequenceParallel``), the row-parallel output reduce-scatters instead of
all-reducing, a region gathers the sequence on entry, the token embedding's output is split,
a replicated position embedding keeps its rank's slice, and the LM head gathers before
projecting. Sequences must divide by the TP size.

Gradients leave the backward in their parameter's layout. DTensor autograd alone does not
promise that: under sequence parallelism a replicated norm weight gets a ``Partial`` gradient
(each rank holds its sequence slice's sum, not the sum), and the vocabulary-sharded embedding
gets a ``Replicate`` full-vocabulary gradient on every rank. The optimizer step would fix the
values, but everything between backward and step reads ``.grad`` as the parameter's layout:
global-norm clipping (a ``Partial`` gradient counted as a shard gives a wrong norm), gradient
norm logging, and the memory budget (a full embedding gradient per rank). A post-accumulate
hook per parameter redistributes the gradient to the parameter's placements (an all-reduce
for ``Partial``, a local slice for ``Replicate`` -> ``Shard``). Under FSDP2 the parameters are
replaced and FSDP2 does the same redistribution itself before reducing over the data axes.

Loss parallelism (``loss_parallel=True``): the LM head keeps its output split over the
vocabulary (a ``Shard(-1)`` DTensor) inside a step scope and ``F.cross_entropy`` runs on the
shards; outside a step it gathers as before. The rules for the user's other uses of the logits
live in :mod:`lightning_parallel.parallel.tensor.loss`.

Composition: apply this before FSDP2 (which then shards the DTensor parameters over the
data-parallel axes) and after a pipeline split.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.attention import (
    RegionForward,
    gather_input_hook,
    install_region,
    settle_output_hook,
    slice_output_hook,
)
from lightning_parallel.parallel.tensor.attention_weights import track_requested_attentions
from lightning_parallel.parallel.tensor.experts import apply_experts_tensor_parallel
from lightning_parallel.parallel.tensor.fused import Conv1DRowwiseParallel, FusedColwiseParallel, is_conv1d
from lightning_parallel.parallel.tensor.head_bias import HeadParameters
from lightning_parallel.parallel.tensor.loss import install_sharded_head
from lightning_parallel.parallel.tensor.rank_order import RankOrderedColwise
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan
from lightning_parallel.parallel.tensor.sequence_stacks import (
    StackSpan,
    check_stacks,
    inside,
    install_stack_layers,
    reads_sequence_length,
    stack_span,
)
from lightning_parallel.parallel.tensor.styles import (
    COLWISE, COLWISE_GATHER, EMBEDDING_COLWISE, EMBEDDING_ROWWISE, EXPERTS, HEAD_PARAMETERS, ROWWISE, ROWWISE_SPLIT_INPUT,
)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def check_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, sequence_parallel: bool, loss_parallel: bool = False
) -> None:
    """Every check :func:`apply_tensor_parallel` makes, with no collective: call it on every rank first."""
    if not isinstance(plan, TensorParallelPlan):
        raise config_error(TypeError, "plan", type(plan).__name__, "must be a TensorParallelPlan", "build it with resolve_tp_plan(module, tp_size)")
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise config_error(
            ValueError, "tp_mesh", tp_mesh, "must be a 1-D DeviceMesh (the tensor-parallel axis)",
            "pass ParallelDims.build_mesh(...) then dims.axis(TP)",
        )
    if tp_mesh.size() != plan.tp_size:
        raise config_error(
            ValueError, "plan.tp_size", plan.tp_size, f"it must equal the tensor-parallel mesh size {tp_mesh.size()}",
            "resolve the plan with the same tensor_parallel_size as the mesh",
        )
    if not isinstance(sequence_parallel, bool):
        raise config_error(TypeError, "sequence_parallel", sequence_parallel, "must be a bool", "pass sequence_parallel=true or false")
    if not isinstance(loss_parallel, bool):
        raise config_error(TypeError, "loss_parallel", loss_parallel, "must be a bool", "pass loss_parallel=true or false")
    modules = dict(module.named_modules())
    missing = [n for n in (*plan.styles, *plan.regions, *plan.norms) if n not in modules]
    if missing:
        raise config_error(
            ValueError, "plan", missing[:5], "names modules this model does not have (resolved for another model?)",
            "call resolve_tp_plan on the module you parallelise",
        )
    already = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if already or any(isinstance(m.__dict__.get("forward"), RegionForward) for m in modules.values()):
        raise config_error(
            RuntimeError, "apply_tensor_parallel", type(module).__name__,
            f"the module is already parallelised (DTensor parameters such as {already[:2]})",
            "apply tensor parallelism once, before data-parallel sharding",
        )
    if sequence_parallel and reads_sequence_length(module):
        check_stacks(module, plan.regions, _experts(plan))
    elif sequence_parallel:
        if not plan.stream_embeddings:
            raise config_error(
                ValueError, "sequence_parallel", True,
                f"{type(module).__name__} has no nn.Embedding producing (batch, sequence, features) hidden states, so there is no sequence to split",
                "set sequence_parallel=false for this model",
            )
        covered = set(plan.styles) | set(plan.norms) | set(plan.stream_embeddings) | set(plan.lm_heads)
        containers = set(plan.regions) | set(plan.blocks)
        unplaced = [
            n for n, m in modules.items()
            if any(True for _ in m.parameters(recurse=False)) and n not in covered and not inside(n, containers)
        ]
        if unplaced:
            raise config_error(
                ValueError, "sequence_parallel", True,
                f"modules {unplaced[:5]} own parameters on the residual stream but are neither a norm, an embedding, "
                "an LM head nor inside an attention/MLP block, so their place in a sequence split is unknown",
                "set sequence_parallel=false, or give a tp_plan marking per-token modules as 'sequence_parallel'",
            )


def _sharded_heads(plan: TensorParallelPlan) -> list[str]:
    """LM heads whose logits can stay split over the vocabulary (loss parallelism)."""
    return [name for name in plan.lm_heads if plan.styles.get(name) == COLWISE_GATHER]


def _colwise(module: nn.Module, split_factor: int, split_bias: bool = False, **kwargs: object) -> ParallelStyle:
    """torch's ``ColwiseParallel`` where it applies, the fused/Conv1D variant elsewhere."""
    if split_factor > 1 or is_conv1d(module):
        return FusedColwiseParallel(split_factor=split_factor, split_bias=split_bias, **kwargs)  # type: ignore[arg-type]
    return ColwiseParallel(**kwargs)  # type: ignore[arg-type]


def _rowwise(module: nn.Module, **kwargs: object) -> ParallelStyle:
    return (Conv1DRowwiseParallel if is_conv1d(module) else RowwiseParallel)(**kwargs)  # type: ignore[arg-type]


def _experts(plan: TensorParallelPlan) -> list[str]:
    return [name for name, style in plan.styles.items() if style == EXPERTS]


def _sequence_span(module: nn.Module, plan: TensorParallelPlan, sequence_parallel: bool) -> StackSpan | None:
    """Sequence parallelism over the block stacks (``sequence_stacks``), or None: none at all, or from
    the embedding to the LM head (the package's own models)."""
    if not sequence_parallel or not reads_sequence_length(module):
        return None
    return stack_span(module, plan.regions, _experts(plan))


def _installed_regions(plan: TensorParallelPlan, span: StackSpan | None) -> list[str]:
    """The modules whose forward runs as a region: the plan's regions, except, over block stacks, a
    region that is a whole stack layer (OPT's, BART's, BERT's MLP, whose linears are the layer's own
    children), which the stack already runs in DTensor semantics: its attention, the outermost block
    inside it, runs as the region instead (gathering the stream where it is read), its column layers
    gather the stream and its rows reduce-scatter to it (``install_stack_layers``).

    Why: as a region, the layer gathered the stream on entry, so its norms and everything between its
    attention and MLP ran on the whole sequence (OPT, 1.28x the minimum; its tokens flattened around
    the MLP then met a ``Shard(1)`` row output splitting the features)."""
    if span is None:
        return list(plan.regions)
    layers = {layer for stack in span.stacks for layer in stack}
    out = [region for region in plan.regions if region not in layers]
    for region in plan.regions:
        if region in layers:
            inner = [b for b in plan.blocks if b != region and inside(b, (region,))]
            out += [b for b in inner if not any(o != b and inside(b, (o,)) for o in inner)]
    return out


def _styles(
    plan: TensorParallelPlan, sequence_parallel: bool, loss_parallel: bool = False, module: nn.Module | None = None,
    span: StackSpan | None = None,
) -> dict[str, ParallelStyle]:
    """One torch ``ParallelStyle`` per planned module (experts modules are split separately).

    ``module`` (the root the plan was resolved on) tells ``Conv1D`` apart from ``nn.Linear``;
    without it every linear is taken for an ``nn.Linear``. ``span``: sequence parallelism over
    block stacks (:func:`_sequence_span`).
    """
    regions = set(plan.regions)
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        in_region = inside(_parent(name), regions)
        # Split along the sequence here: every module under sequence parallelism, or only the stacks' layers.
        sp = sequence_parallel and (span is None or name in span.split)
        mod = module.get_submodule(name) if module is not None else nn.Linear(1, 1)
        packed = plan.packed.get(name, 1)
        if style == COLWISE and in_region and name in plan.packed_sizes:  # unequal parts: rank order
            out[name] = RankOrderedColwise(sizes=plan.packed_sizes[name])
        elif style == COLWISE:
            # In a region the output stays a DTensor (global shapes for the user's reshapes).
            out[name] = _colwise(mod, packed, plan.packed_biases_split, use_local_output=not in_region)
        elif style in (ROWWISE, ROWWISE_SPLIT_INPUT):
            # Hugging Face's "rowwise_split_input": the input arrives whole and is sliced here. Under
            # sequence parallelism the output is reduce-scattered and stays a DTensor in the region, so
            # what the region computes after it (BERT's residual add and norm) keeps global semantics.
            # Over block stacks the partial output is reduce-scattered by a hook to the stream's own
            # placement, which may be the tokens flattened (``flat_stream.reduce_to_stream``).
            inputs = {"input_layouts": Replicate()} if style == ROWWISE_SPLIT_INPUT else {}
            split_out: Placement = Partial() if span is not None else Shard(1)
            out[name] = _rowwise(mod, **inputs, output_layouts=split_out if sp and in_region else Replicate(),
                                 use_local_output=not (sp and in_region))
        elif style == COLWISE_GATHER:
            reads_stream = sp and span is None and name in plan.lm_heads
            inputs = Shard(1) if reads_stream else Replicate()
            if loss_parallel and name in plan.lm_heads:  # vocabulary-sharded DTensor; tp_loss decides per call
                out[name] = _colwise(mod, packed, plan.packed_biases_split, input_layouts=inputs, output_layouts=Shard(-1),
                                     use_local_output=False)
            else:
                out[name] = _colwise(mod, packed, plan.packed_biases_split, input_layouts=inputs, output_layouts=Replicate())
        elif style == HEAD_PARAMETERS:
            out[name] = HeadParameters()
        elif style == EMBEDDING_COLWISE:  # one column per head: the lookup stays split in its region
            out[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1) if in_region else Replicate(),
                                        use_local_output=not in_region)
        elif style == EMBEDDING_ROWWISE:
            writes_stream = sp and span is None and name in plan.stream_embeddings
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if writes_stream else Replicate())
        elif style == EXPERTS:
            continue
        else:  # pragma: no cover - resolve_tp_plan only stores sharding styles here
            raise AssertionError(f"unexpected style {style!r} for {name}")
    for name in plan.norms if sequence_parallel and span is None else ():
        out[name] = SequenceParallel(use_local_output=True)
    return out


def _ties(module: nn.Module, names: set[str]) -> list[list[tuple[str, str]]]:
    """Groups of (module, parameter name) sharing one Parameter, among the planned modules."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for local, param in mod.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, local))
    return [group for group in owners.values() if len(group) > 1 and any(m in names for m, _ in group)]


def _grad_to_param_layout(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: give ``param.grad`` the placements of ``param`` (see module doc)."""
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        with torch.no_grad():
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> None:
    """Parallelise ``module`` in place over the 1-D ``tp_mesh`` following ``plan``.

    All input checks run before the first collective (see :func:`check_tensor_parallel`).
    Every rank must hold the same initial weights or, as ``distribute_tensor`` does, rank 0's
    are used. Build the optimizer after this call: the parameters are new DTensor objects.
    """
    check_tensor_parallel(module, tp_mesh, plan, sequence_parallel, loss_parallel)
    # Sequence parallelism from the embedding to the LM head (plain local slices between the regions),
    # or over the block stacks (a Shard(1) DTensor stream the regions recognise: ``sequence_stacks``).
    span = _sequence_span(module, plan, sequence_parallel)
    styles = _styles(plan, sequence_parallel, loss_parallel, module, span)
    ties = _ties(module, set(styles))
    parallelize_module(module, tp_mesh, styles)
    for name, style in plan.styles.items():
        if style == EXPERTS:
            apply_experts_tensor_parallel(module.get_submodule(name), tp_mesh)
    for group in ties:  # parallelize_module distributes each owner separately: tie them again, to a split one
        first_mod, first_local = next(((m, local) for m, local in group if m in styles), group[0])
        shared = getattr(module.get_submodule(first_mod), first_local)
        for mod_name, local in group:
            setattr(module.get_submodule(mod_name), local, shared)
    for name in styles:  # outside regions (which settle their own outputs): plain tensors, not pending collectives
        if not inside(name, set(plan.regions)):
            module.get_submodule(name).register_forward_hook(settle_output_hook)
    for param in {id(p): p for p in module.parameters()}.values():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_grad_to_param_layout)
    if loss_parallel:
        heads = _sharded_heads(plan)
        if not heads:
            warnings.warn(
                f"loss_parallel=True but the plan shards no LM head of {type(module).__name__} over the vocabulary "
                f"(lm_heads={list(plan.lm_heads)}): the loss runs on replicated logits. HINT: check the plan table "
                "(python -m lightning_parallel.plan), or set loss_parallel=False",
                stacklevel=2,
            )
        install_sharded_head(module, heads)
    sp = sequence_parallel and span is None
    if plan.regions:
        track_requested_attentions(module)
    head_embeddings = [name for name, style in plan.styles.items() if style == EMBEDDING_COLWISE]
    for name in (*_installed_regions(plan, span), *(span.gathered if span is not None else ())):
        install_region(module.get_submodule(name), tp_mesh, dtensor_region=True, gather_input=sp,
                       keep_heads=any(inside(e, (name,)) for e in head_embeddings))
    if span is not None:
        columns = [name for name, style in plan.styles.items() if style == COLWISE]
        rows = [name for name, style in plan.styles.items() if style in (ROWWISE, ROWWISE_SPLIT_INPUT)]
        install_stack_layers(module, tp_mesh, span.stacks, columns, rows)
    if not sp:
        return
    for name in plan.blocks:
        if name not in plan.regions and not inside(name, set(plan.regions)):
            # A replicated attention/MLP (e.g. heads not divisible): full sequence in, own slice out.
            install_region(module.get_submodule(name), tp_mesh, dtensor_region=False, gather_input=True, slice_output=True)
    for name in plan.stream_embeddings:
        if name not in plan.styles:
            module.get_submodule(name).register_forward_hook(slice_output_hook(tp_mesh))
    for name in plan.lm_heads:
        if name not in plan.styles:
            module.get_submodule(name).register_forward_pre_hook(gather_input_hook(tp_mesh))
