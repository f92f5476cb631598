"""Which module gets which tensor-parallel style: the plan, where it comes from, what it costs.

A plan is computed without a process group and works on a meta-device model, so the same code
serves the Lightning strategy (before any collective: bad input fails on every rank at once)
and the dry run (no processes at all). Precedence, highest first, taken whole (never merged,
so one source's pairing of column- and row-parallel layers is never half-overridden by
another's): a plan given in the strategy's config (glob of module names -> style), a plan the
model declares (Hugging Face convention: ``_tp_plan`` on a module, ``config.base_model_tp_plan``),
a plan inferred from the structure (:func:`lightning_parallel.parallel.tensor.infer.analyse`).
One exception: a declared plan is completed by inferred *groups* that it does not mention at
all (see :func:`resolve_tp_plan`), so no pairing is ever split between sources.

Hugging Face's style names (transformers 5) map onto these: ``colwise``, ``rowwise``,
``colwise_gather_output``/``colwise_rep``, ``rowwise_split_input``/``rowwise_rep``,
``embedding_rowwise``, ``packed_colwise`` (the output packs equal parts, see
:mod:`~lightning_parallel.parallel.tensor.fused`), ``moe_tp_experts`` (see
:mod:`~lightning_parallel.parallel.tensor.experts`), ``replicated_with_grad_allreduce`` (replicate);
the rest (:data:`~lightning_parallel.parallel.tensor.styles.UNSUPPORTED_HF_STYLES`) and unknown ones leave their modules to the inferred
plan with a note in ``plan.warnings``. A user's ``tp_plan`` with an unknown style is an error.

Why whole groups: a column-parallel q/k/v with a replicated output projection computes garbage.
So a divisibility failure in one member of a group (the linears under one parent module)
keeps the whole group replicated, with a warning naming the module, or an error under
``strict``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.declared import declared_plan, fold_layer_index, generalised, styles_from_globs, upgrade_gathered_pairs
from lightning_parallel.parallel.tensor.experts import experts_layout
from lightning_parallel.parallel.tensor.fused import features, is_linear_like
from lightning_parallel.parallel.tensor.infer import Structure, analyse, head_counts
from lightning_parallel.parallel.tensor.styles import (
    COLWISE,
    COLWISE_GATHER,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    EXPERTS,
    HEAD_PARAMETERS,
    REPLICATE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SEQUENCE_PARALLEL,
    SHARDING_STYLES,
    _COLUMN_STYLES,
    _ROW_STYLES,
)
from lightning_parallel.parallel.tensor.shards import owned_params, param_shard

@dataclass
class TensorParallelPlan:
    """The resolved plan: one entry per module with parameters, plus what sequence parallelism needs.

    ``styles`` holds the sharded modules (FQN -> one of :data:`SHARDING_STYLES`); ``replicated``
    every other module owning parameters, with the reason it stays whole. ``regions`` are the
    modules (attention, MLP) whose forward sees the column-parallel outputs; the structural
    fields (``norms``, ``stream_embeddings``, ``lm_heads``, ``blocks``) tell sequence
    parallelism where the residual stream is split and gathered.
    """

    tp_size: int
    source: str
    styles: dict[str, str]
    replicated: dict[str, str]
    regions: tuple[str, ...]
    norms: tuple[str, ...]
    stream_embeddings: tuple[str, ...]
    lm_heads: tuple[str, ...]
    blocks: tuple[str, ...]
    total_params: int
    sharded_params: int
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # Column-parallel modules whose output packs n equal parts ([q | k | v], [gate | up]): their
    # weights are sharded ``_StridedShard(dim, n)`` so each rank holds its slice of every part.
    packed: dict[str, int] = field(default_factory=dict)
    pairs_from: str = ""  # "dataflow", or why module names and shapes decided (infer.py)
    # No FSDP2 shards these parameters beside tp (no data parallelism): packed nn.Linear weights and
    # packed biases split ``_StridedShard`` too (resolve_tp_plan's ``fsdp_composable``).
    packed_biases_split: bool = False
    # Column-parallel nn.Linear modules whose output packs parts of different sizes (Phi-3's
    # grouped-query [q | k | v]): the sizes. Their parameters are stored in rank order and split
    # Shard(0) (:mod:`~lightning_parallel.parallel.tensor.rank_order`); only without FSDP2 beside tp.
    packed_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def fraction_sharded(self) -> float:
        """Fraction of the model's parameters (elements) that are split across the TP ranks."""
        return self.sharded_params / self.total_params if self.total_params else 0.0

    def style_of(self, name: str) -> str:
        return self.styles.get(name, REPLICATE)

    def table(self) -> str:
        """Module -> style, repeated layers folded (``layers.*``), and the sharded fraction."""
        entries = list(self.styles.items()) + [(n, f"{REPLICATE} ({r})") for n, r in self.replicated.items()]
        folded: dict[tuple[str, str], int] = {}
        for name, style in entries:
            key = (fold_layer_index(name), style)
            folded[key] = folded.get(key, 0) + 1
        rows: dict[tuple[str, str], int] = {}
        for name, style in entries:  # fold layer indices only where a pattern really repeats
            key = (fold_layer_index(name), style) if folded[(fold_layer_index(name), style)] > 1 else (name, style)
            rows[key] = rows.get(key, 0) + 1
        width = max([len(k[0]) for k in rows] + [6])
        lines = [f"Tensor-parallel plan (tp={self.tp_size}, source={self.source})", f"{'module':<{width}}  style"]
        lines[1:1] = [f"pairs found from: {self.pairs_from}"] if self.pairs_from else []
        for (name, style), count in rows.items():
            lines.append(f"{name:<{width}}  {style}" + (f"  x{count}" if count > 1 else ""))
        lines.append(
            f"sharded {self.sharded_params:,} of {self.total_params:,} parameters "
            f"({100.0 * self.fraction_sharded:.1f}%)"
        )
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def _divisibility(module: nn.Module, name: str, style: str, tp: int, packed: dict[str, int]) -> list[tuple[str, int]]:
    """(what, size) pairs that must divide by ``tp`` for ``style`` on module ``name``."""
    mod = module.get_submodule(name)
    if style in _COLUMN_STYLES:
        n = packed.get(name, 1)
        out = features(mod)[1]
        return [("out_features", out)] if n == 1 else [(f"out_features per packed part ({n} parts)", out // n)]
    if style in _ROW_STYLES:
        return [("in_features", features(mod)[0])]
    if style == EMBEDDING_ROWWISE:
        return [("vocabulary size (num_embeddings)", mod.num_embeddings)]
    if style == EMBEDDING_COLWISE:
        return [("embedding width (embedding_dim)", mod.embedding_dim)]
    if style == HEAD_PARAMETERS:
        return [(f"leading dim of `{n}` (heads)", p.shape[0]) for n, p in mod.named_parameters(recurse=False)]
    if style == EXPERTS:
        layout = experts_layout(mod)
        return [("expert intermediate size", layout[2])] if layout else []
    return []


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _outermost(regions: set[str]) -> list[str]:
    """Regions not inside another (which runs its whole forward on DTensors already: BERT's layer)."""
    return [""] if "" in regions else sorted(r for r in regions if not any(r.startswith(f"{o}.") for o in regions if o != r))


def _finalise(
    module: nn.Module, tp: int, source: str, styles: dict[str, str], groups: dict[str, list[str]],
    reasons: dict[str, str], structure: Structure, strict: bool, notes: list[str], packed: dict[str, int],
    packed_biases_split: bool = False,
) -> TensorParallelPlan:
    """Check divisibility per group (drop or raise), count parameters, build the plan."""
    all_modules = dict(module.named_modules())
    for group_key, members in groups.items():
        checks: list[tuple[str, str, int]] = []
        for name in members:
            checks += [(name, what, size) for what, size in _divisibility(module, name, styles[name], tp, packed)]
        parent = all_modules.get(group_key)
        if parent is not None and any(styles[m] in (COLWISE, ROWWISE) for m in members):
            heads, kv_heads = head_counts(parent)
            if heads is not None:
                checks.append((group_key, "attention heads", heads))
            if kv_heads is not None:
                checks.append((group_key, "key/value heads", kv_heads))
        bad = [(n, what, size) for n, what, size in checks if size % tp]
        if not bad:
            continue
        n, what, size = bad[0]
        if strict:
            raise config_error(
                ValueError, "tensor_parallel_size", tp,
                f"module `{n}` has {what}={size}, which is not divisible by the tensor-parallel size {tp}",
                f"choose a tensor_parallel_size that divides {size}, or strict_plan=false to keep `{n}` replicated",
            )
        msg = f"module `{n}`: {what}={size} is not divisible by tensor_parallel_size={tp}; kept replicated"
        notes.append(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)
        for name in members:
            styles.pop(name, None)
            packed.pop(name, None)
            reasons[name] = f"{what} {size} % tp {tp} != 0"
    # Tied weights split the same way (embedding rowwise, gathered head: dim 0). A module only holding a
    # tied parameter (BERT's ``cls.predictions.bias``, its decoder's) follows the one computing with it;
    # dropping a style can break another tie (the decoder's weight): repeat.
    by_param: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in module.named_modules():
        for local, p in mod.named_parameters(recurse=False):
            by_param.setdefault(id(p), []).append((mod_name, local))
    changed = True
    while changed:
        changed = False
        for owners in (o for o in by_param.values() if len(o) > 1):
            computing = [(o, local) for o, local in owners if o in styles or is_linear_like(all_modules[o])
                         or isinstance(all_modules[o], nn.Embedding)]
            kinds = {param_shard(styles, packed, all_modules[o], o, local) for o, local in computing}
            if len(kinds) > 1:
                for o, _ in owners:
                    if o in styles:
                        styles.pop(o)
                        changed = True
                        reasons[o] = f"weight tied to {', '.join(x for x, _ in owners if x != o)} which is split differently"
    total = sharded = 0
    replicated: dict[str, str] = {}
    for mod_name, local, param in owned_params(module):
        total += param.numel()
        if mod_name in styles and param_shard(styles, packed, all_modules[mod_name], mod_name, local, packed_biases_split) is not None:
            sharded += param.numel()
        elif mod_name not in styles:
            replicated[mod_name] = reasons.get(mod_name) or structure.reason(mod_name)
    regions = _outermost({structure.region_of.get(n, _parent(n)) for n, s in styles.items() if s in _ROW_STYLES})
    return TensorParallelPlan(
        tp_size=tp, source=source, styles=styles, replicated=replicated, regions=tuple(regions),
        norms=structure.norms, stream_embeddings=structure.stream_embeddings, lm_heads=structure.lm_heads,
        blocks=structure.blocks, total_params=total, sharded_params=sharded, warnings=tuple(notes),
        packed={n: f for n, f in packed.items() if n in styles}, packed_biases_split=packed_biases_split, pairs_from="; ".join(
            f"{root or type(module).__name__}: {how}" for root, how in structure.method.items()) or "module names and shapes "
        "(no forward to record: a Hugging Face model's dummy_inputs or the LightningModule's example_input_array)"
        if tp > 1 else "",
    )


def inferred_styles(structure: Structure) -> dict[str, str]:
    """The inferred plan: pairs column/row-parallel, the vocabulary split, heads gathered, experts split."""
    kinds = {n: COLWISE for n in structure.column} | {n: ROWWISE for n in structure.row}
    if structure.vocab_embedding is not None:
        kinds[structure.vocab_embedding] = EMBEDDING_ROWWISE
    kinds.update({h: COLWISE_GATHER for h in structure.lm_heads})
    kinds.update({e: EMBEDDING_COLWISE for e in structure.head_embeddings})
    kinds.update({m: HEAD_PARAMETERS for m in structure.head_parameters})
    kinds.update({e: EXPERTS for e in structure.experts})
    # In group order (layer by layer, q/k/v before o), which is the order the table prints.
    return {m: kinds[m] for members in structure.groups.values() for m in members if m in kinds}


def _inferred_groups(structure: Structure, styles: dict[str, str]) -> dict[str, list[str]]:
    return {key: [m for m in members if m in styles] for key, members in structure.groups.items()}


def _declared_groups(styles: dict[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in styles:
        groups.setdefault(_parent(name) if styles[name] in (COLWISE, ROWWISE, ROWWISE_SPLIT_INPUT) else name, []).append(name)
    return groups


def _gather_unpaired(styles: dict[str, str], notes: list[str], groups: dict[str, list[str]] | None = None) -> None:
    """A column-parallel layer with no row-parallel sibling gathers its output.

    Its split output would otherwise reach code written for the whole one (a replicated
    projection, a residual add): a half-applied declared plan (one member's style unsupported)
    or a user plan naming only the first layer of a pair. Gathering is always correct.
    """
    with_rows = {_parent(n) for n, s in styles.items() if s in _ROW_STYLES}
    paired = {m for members in (groups or {}).values() if any(styles.get(r) in _ROW_STYLES for r in members) for m in members}
    for name, style in list(styles.items()):
        if style == COLWISE and _parent(name) not in with_rows and name not in paired:
            styles[name] = COLWISE_GATHER
            notes.append(f"module {name!r}: colwise with no row-parallel layer beside it; its output is gathered")


def _unpack_linears(module: nn.Module, packed: dict[str, object], notes: list[str]) -> None:
    """An ``nn.Linear`` packs along dim 0 of its weight, the dim FSDP2 shards too, and FSDP2 does
    not compose with a ``_StridedShard`` tensor-parallel placement on its own dim (measured:
    dp2 x tp2 zero3 trained such a weight to a relative error of 1.0). Such a layer is split as a
    plain column-parallel one: still exact (DTensor gathers where its output is cut into parts),
    without the per-part split. ``Conv1D`` (dim 1) and experts (dim 1) keep theirs."""
    for name in [n for n in packed if isinstance(module.get_submodule(n), nn.Linear)]:
        packed.pop(name)
        notes.append(f"module {name!r}: packed nn.Linear split as plain colwise (its output parts are gathered where cut)")


def _no_split_error(module: nn.Module, tp: int, plan: TensorParallelPlan) -> ValueError:
    """The plan splits nothing: name the biggest modules and why they cannot be split."""
    sizes: dict[str, int] = {}
    for mod_name, _, param in owned_params(module):
        sizes[mod_name] = sizes.get(mod_name, 0) + param.numel()
    biggest = sorted(sizes, key=lambda n: -sizes[n])[:4]
    kinds = sorted({type(module.get_submodule(n)).__name__ for n in sizes})
    listed = ", ".join(f"`{n}` ({type(module.get_submodule(n)).__name__}: {plan.replicated.get(n, 'replicated')})" for n in biggest)
    return config_error(
        ValueError, "tensor_parallel_size", tp,
        f"tensor parallelism finds nothing to split in {type(module).__name__}: no attention or MLP projection pair "
        f"(nn.Linear/Conv1D), vocabulary embedding or experts module; convolutions and batch norms have no "
        f"tensor-parallel plan here (module types: {kinds[:8]}). Largest modules: {listed}",
        "use a data-parallel strategy for this model (strategy='dp' or 'zero3'), or give tp_plan={...} naming "
        "nn.Linear/nn.Embedding modules to split",
    )


def resolve_tp_plan(
    module: nn.Module, tp_size: int, user_plan: dict[str, str] | None = None, strict: bool = False,
    split_experts: bool = True, fsdp_composable: bool = True,
) -> TensorParallelPlan:
    """The plan for ``module`` at ``tp_size``: the user's, else the declared one, else inferred.

    Needs no process group and reads only shapes, so it runs on a meta-device model and before
    any collective. Raises a ValueError/TypeError for a bad user plan (unknown module, with
    close matches; unknown style; style that does not fit the module type), for a model in which
    nothing can be split (``tp_size > 1``), and, with ``strict``, for any size not divisible by
    ``tp_size``. ``split_experts=False`` leaves Hugging Face experts modules to expert
    parallelism (both would otherwise split the same parameters). ``fsdp_composable=False``: no
    FSDP2 will shard these parameters beside tp (no data parallelism), so packed ``nn.Linear``
    weights and packed biases keep their per-part ``_StridedShard`` split, which FSDP2 does not
    compose with (:func:`_unpack_linears`); each part is then cut locally, without an all-gather.

    A declared (Hugging Face) plan is used for what it covers and completed by the inferred plan,
    group by group: an inferred group none of whose modules the declared plan names is added
    whole (Qwen2-MoE declares ``mlp.gate_proj``/``up_proj``/``down_proj``, which its sparse layers
    do not have, and misses their ``shared_expert``; GPT-OSS declares its embedding only).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise config_error(TypeError, "tensor_parallel_size", tp_size, "must be an int", "pass e.g. tensor_parallel_size=2")
    if tp_size < 1:
        raise config_error(ValueError, "tensor_parallel_size", tp_size, "must be >= 1", "pass e.g. tensor_parallel_size=2")
    if user_plan is not None and not isinstance(user_plan, dict):
        raise config_error(TypeError, "tp_plan", user_plan, "must be a dict of module-name glob -> style", "e.g. {'blocks.*.mlp.fc': 'colwise'}")
    structure = analyse(module, tp_size)
    notes: list[str] = []
    reasons: dict[str, str] = {}
    packed: dict[str, int] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    declared = declared_plan(module) if not user_plan else {}
    if user_plan:
        source = "user"
        styles, _ = styles_from_globs(module, dict(user_plan), user=True, notes=notes, packed=packed)
    elif declared:
        source = "declared"
        styles, named = styles_from_globs(module, declared, user=False, notes=notes, packed=packed)
        inferred = inferred_styles(structure)
        upgraded = upgrade_gathered_pairs(styles, inferred, _inferred_groups(structure, inferred), structure.packed,
                                          packed, notes)
        sizes.update({m: structure.packed_sizes[m] for m in upgraded if m in structure.packed_sizes})
        added: list[str] = []
        for members in _inferred_groups(structure, inferred).values():
            if members and not any(m in named or m in styles for m in members):
                styles.update({m: inferred[m] for m in members})
                packed.update({m: structure.packed[m] for m in members if m in structure.packed})
                sizes.update({m: structure.packed_sizes[m] for m in members if m in structure.packed_sizes})
                added += members
        if added:
            source = "declared+inferred"
            notes.append(f"the declared plan does not reach {len(added)} module(s) the inferred plan splits "
                         f"(e.g. {generalised(added)[:3]}); they follow the inferred plan")
    else:
        source = "inferred"
        styles = inferred_styles(structure)
        packed.update({m: f for m, f in structure.packed.items() if m in styles})
        sizes.update({m: f for m, f in structure.packed_sizes.items() if m in styles})
    for name in [n for n, s in styles.items() if s not in SHARDING_STYLES]:
        reasons[name] = "replicate (plan)" if styles[name] == REPLICATE else "norm: sequence-sharded under sequence_parallel"
        if styles.pop(name) == SEQUENCE_PARALLEL and name not in structure.norms:
            structure.norms = tuple(structure.norms) + (name,)
    if not split_experts:  # expert parallelism owns the experts (the strategy passes ep == 1 here)
        for name in [n for n, s in styles.items() if s == EXPERTS]:
            styles.pop(name)
            reasons[name] = "experts: split by expert parallelism (expert_parallel_size > 1), not by tp"
    _gather_unpaired(styles, notes, structure.groups if source != "user" else None)
    if fsdp_composable:
        _unpack_linears(module, packed, notes)
        _unpack_linears(module, sizes, notes)
    if source == "inferred":
        groups = _inferred_groups(structure, styles)
    else:
        groups = _declared_groups(styles)
    plannable = bool(styles)  # before divisibility: an empty plan after it has warned per module
    plan = _finalise(module, tp_size, source, styles, groups, reasons, structure, strict, notes, packed, not fsdp_composable)
    plan.packed_sizes = {n: f for n, f in sizes.items() if plan.styles.get(n) == COLWISE
                         and isinstance(module.get_submodule(n), nn.Linear)}
    if tp_size > 1 and plan.total_params and not plannable and source != "user":
        raise _no_split_error(module, tp_size, plan)
    if tp_size > 1:
        _warn_whole_projections(module, plan)
    return plan


def _warn_whole_projections(module: nn.Module, plan: TensorParallelPlan) -> None:
    """Say which projections (linears, ``Conv1D``, ``nn.MultiheadAttention``) stay whole, and why.

    The plan table (logged by the strategy) lists every module; this warning is for the ones a
    reader would expect split, so a model that trains with a partial split says so.
    """
    whole: dict[tuple[str, str], int] = {}
    for name, reason in plan.replicated.items():
        mod = module.get_submodule(name)
        if reason == "replicate (plan)" or not (is_linear_like(mod) or isinstance(mod, nn.MultiheadAttention)):
            continue
        if name.rpartition(".")[0] in plan.replicated and isinstance(module.get_submodule(name.rpartition(".")[0]), nn.MultiheadAttention):
            continue  # its MultiheadAttention is listed
        key = (fold_layer_index(name), reason)
        whole[key] = whole.get(key, 0) + 1
    if not whole:
        return
    listed = "; ".join(f"`{n}`{f' x{c}' if c > 1 else ''}: {r}" for (n, r), c in list(whole.items())[:8])
    msg = (f"tensor parallelism (tp={plan.tp_size}) keeps these projections whole on every rank: {listed}. "
           f"{100.0 * plan.fraction_sharded:.1f}% of the parameters are split. HINT: pass tp_plan={{...}} to split them")
    plan.warnings = (*plan.warnings, msg)
    warnings.warn(msg, UserWarning, stacklevel=3)
