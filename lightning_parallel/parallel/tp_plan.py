"""Which module gets which tensor-parallel style: the plan, where it comes from, what it costs.

A plan is computed without a process group and works on a meta-device model, so the same code
serves the Lightning strategy (before any collective: bad input fails on every rank at once)
and the dry run (no processes at all). Precedence, highest first, taken whole (never merged,
so one source's pairing of column- and row-parallel layers is never half-overridden by
another's): a plan given in the strategy's config (glob of module names -> style), a plan the
model declares (Hugging Face convention: ``_tp_plan`` on a module, ``config.base_model_tp_plan``),
a plan inferred from the structure (:func:`lightning_parallel.parallel.tp_infer.analyse`).

Why whole groups: a column-parallel q/k/v with a replicated output projection computes garbage.
So a divisibility failure in one member of a group (the linears under one parent module)
keeps the whole group replicated, with a warning naming the module, or an error under
``strict``.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tp_infer import Structure, analyse, head_counts

COLWISE = "colwise"
ROWWISE = "rowwise"
COLWISE_GATHER = "colwise_gather_output"
EMBEDDING_ROWWISE = "embedding_rowwise"
SEQUENCE_PARALLEL = "sequence_parallel"
REPLICATE = "replicate"
STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, EMBEDDING_ROWWISE, SEQUENCE_PARALLEL, REPLICATE)
SHARDING_STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, EMBEDDING_ROWWISE)
STYLE_ALIASES = {
    # Hugging Face names. Their "local_*" variants leave shapes to the model code; here every
    # sharded layer keeps global shapes inside its block, so they mean the same thing.
    "colwise_rep": COLWISE_GATHER,
    "gather_output": COLWISE_GATHER,
    "rowwise_rep": ROWWISE,
    "local_colwise": COLWISE,
    "local_rowwise": ROWWISE,
    "vocab_parallel": EMBEDDING_ROWWISE,
    "replicated": REPLICATE,
}
_LINEAR_STYLES = (COLWISE, ROWWISE, COLWISE_GATHER)


def canonical_style(style: object, *, where: str) -> str:
    """Map a style name (or a Hugging Face alias) to one of :data:`STYLES`, or raise."""
    if not isinstance(style, str):
        raise config_error(TypeError, where, style, "a tensor-parallel style is a string", f"use one of {list(STYLES)}")
    name = style.strip().lower()
    name = STYLE_ALIASES.get(name, name)
    if name not in STYLES:
        close = difflib.get_close_matches(name, list(STYLES) + list(STYLE_ALIASES), n=3, cutoff=0.4)
        raise config_error(
            ValueError, where, style, f"unknown tensor-parallel style (close matches: {close or 'none'})",
            f"use one of {list(STYLES)} (Hugging Face aliases {sorted(STYLE_ALIASES)} are accepted too)",
        )
    return name


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
        for (name, style), count in rows.items():
            lines.append(f"{name:<{width}}  {style}" + (f"  x{count}" if count > 1 else ""))
        lines.append(
            f"sharded {self.sharded_params:,} of {self.total_params:,} parameters "
            f"({100.0 * self.fraction_sharded:.1f}%)"
        )
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def fold_layer_index(name: str) -> str:
    """``blocks.3.attn.q`` -> ``blocks.*.attn.q``: one table row per repeated layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def sharded_dims(style: str, param_name: str) -> int | None:
    """The tensor dim a style splits for a parameter of its module (None: replicated)."""
    if style in (COLWISE, COLWISE_GATHER, EMBEDDING_ROWWISE):
        return 0
    if style == ROWWISE:
        return 1 if param_name == "weight" else None
    return None


def _owned_params(module: nn.Module) -> list[tuple[str, str, nn.Parameter]]:
    """(module FQN, local name, parameter), each shared parameter once, at its first owner."""
    seen: set[int] = set()
    out = []
    for mod_name, mod in module.named_modules():
        for local, param in mod.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                out.append((mod_name, local, param))
    return out


def tp_param_bytes(module: nn.Module, plan: TensorParallelPlan, tp_size: int | None = None) -> dict[str, object]:
    """Per-rank parameter bytes under ``plan``: sharded, replicated, total, and per module.

    Works on a meta-device model (only shapes and dtypes are read), which is what the dry
    run prints. A sharded dim is split like ``torch.chunk``, so rank 0 holds the largest piece.
    """
    tp = plan.tp_size if tp_size is None else tp_size
    sharded = replicated = full = 0
    per_module: dict[str, int] = {}
    for mod_name, local, param in _owned_params(module):
        dim = sharded_dims(plan.style_of(mod_name), local)
        nbytes = param.numel() * param.element_size()
        full += nbytes
        if dim is None or tp == 1:
            replicated += nbytes
            rank_bytes = nbytes
        else:
            size = param.shape[dim]
            rank_bytes = nbytes // size * -(-size // tp)
            sharded += rank_bytes
        per_module[mod_name] = per_module.get(mod_name, 0) + rank_bytes
    return {
        "sharded_bytes_per_rank": sharded,
        "replicated_bytes_per_rank": replicated,
        "total_bytes_per_rank": sharded + replicated,
        "unsharded_total_bytes": full,
        "per_module_bytes_per_rank": per_module,
        "replicated_modules": dict(plan.replicated),
    }


def _glob_match(pattern: str, name: str) -> bool:
    """Segment-wise glob, as ``torch.distributed.tensor.parallel.parallelize_module`` matches."""
    pat, parts = pattern.split("."), name.split(".")
    return len(pat) == len(parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(pat, parts))


def _generalised(names: list[str]) -> list[str]:
    return sorted({fold_layer_index(n) for n in names} | set(names))


def declared_plan(module: nn.Module) -> dict[str, str]:
    """The plan a model declares the Hugging Face way, as FQN globs (empty when none).

    ``config.base_model_tp_plan`` keys are relative to the base model (the submodule named by
    ``base_model_prefix`` when there is one); ``_tp_plan`` keys are relative to the module that
    carries them and win over the config's.
    """
    plan: dict[str, str] = {}
    owned: dict[str, str] = {}
    seen_configs: set[int] = set()  # submodules often share the root's config: read it once, at the top
    for name, mod in module.named_modules():
        prefix = f"{name}." if name else ""
        config = getattr(mod, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        if isinstance(base, dict) and id(config) not in seen_configs:
            seen_configs.add(id(config))
            base_prefix = getattr(mod, "base_model_prefix", "")
            if isinstance(base_prefix, str) and base_prefix and isinstance(getattr(mod, base_prefix, None), nn.Module):
                prefix_b = f"{prefix}{base_prefix}."
            else:
                prefix_b = prefix
            plan.update({prefix_b + k: v for k, v in base.items()})
        own = getattr(mod, "_tp_plan", None)
        if isinstance(own, dict):
            owned.update({prefix + k: v for k, v in own.items()})
    plan.update(owned)
    return plan


def _styles_from_globs(module: nn.Module, globs: dict[str, str], *, user: bool, notes: list[str]) -> dict[str, str]:
    """Expand glob -> style into FQN -> canonical style; user mistakes raise, declared ones warn."""
    modules = dict(module.named_modules())
    names = [n for n in modules if n]
    styles: dict[str, str] = {}
    ordered = sorted(globs.items(), key=lambda kv: kv[0] in modules)  # exact names applied last
    for pattern, raw_style in ordered:
        where = f"tp_plan[{pattern!r}]"
        if not isinstance(pattern, str):
            raise config_error(TypeError, "tp_plan", pattern, "plan keys are module-name globs (str)", "use e.g. 'layers.*.mlp.up_proj'")
        try:
            style = canonical_style(raw_style, where=where)
        except (TypeError, ValueError):
            if user:
                raise
            notes.append(f"declared plan entry {pattern!r}: style {raw_style!r} is not supported; module left replicated")
            continue
        matched = [n for n in names if _glob_match(pattern, n)]
        if not matched:
            if user:
                close = difflib.get_close_matches(pattern, _generalised(names), n=5, cutoff=0.5)
                raise config_error(
                    ValueError, "tp_plan", pattern, f"no module matches this name (close matches: {close or 'none'})",
                    "use module names as in model.named_modules(); '*' matches one dotted component",
                )
            notes.append(f"declared plan entry {pattern!r} matches no module; ignored")
            continue
        for name in matched:
            mod = modules[name]
            if style == ROWWISE and isinstance(mod, nn.Embedding):
                style_here = EMBEDDING_ROWWISE
            else:
                style_here = style
            ok = (
                (style_here in _LINEAR_STYLES and isinstance(mod, nn.Linear))
                or (style_here == EMBEDDING_ROWWISE and isinstance(mod, nn.Embedding))
                or style_here in (SEQUENCE_PARALLEL, REPLICATE)
            )
            if not ok:
                msg = f"style {style_here!r} needs an nn.Linear (colwise/rowwise) or nn.Embedding (embedding_rowwise), got {type(mod).__name__}"
                if user:
                    raise config_error(ValueError, where, name, msg, "choose a style that fits the module type, or 'replicate'")
                notes.append(f"declared plan: module {name!r}: {msg}; left replicated")
                continue
            styles[name] = style_here
    return styles


def _divisibility(module: nn.Module, name: str, style: str, tp: int) -> list[tuple[str, int]]:
    """(what, size) pairs that must divide by ``tp`` for ``style`` on module ``name``."""
    mod = module.get_submodule(name)
    if style in (COLWISE, COLWISE_GATHER):
        return [("out_features", mod.out_features)]
    if style == ROWWISE:
        return [("in_features", mod.in_features)]
    if style == EMBEDDING_ROWWISE:
        return [("vocabulary size (num_embeddings)", mod.num_embeddings)]
    return []


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _finalise(
    module: nn.Module, tp: int, source: str, styles: dict[str, str], groups: dict[str, list[str]],
    reasons: dict[str, str], structure: Structure, strict: bool, notes: list[str],
) -> TensorParallelPlan:
    """Check divisibility per group (drop or raise), count parameters, build the plan."""
    all_modules = dict(module.named_modules())
    for group_key, members in groups.items():
        checks: list[tuple[str, str, int]] = []
        for name in members:
            checks += [(name, what, size) for what, size in _divisibility(module, name, styles[name], tp)]
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
            reasons[name] = f"{what} {size} % tp {tp} != 0"
    # Tied weights must be split the same way (embedding rowwise and a gathered head both split dim 0).
    by_param: dict[int, list[str]] = {}
    for mod_name, mod in module.named_modules():
        for _, p in mod.named_parameters(recurse=False):
            by_param.setdefault(id(p), []).append(mod_name)
    for owners in by_param.values():
        kinds = {sharded_dims(styles.get(o, REPLICATE), "weight") for o in owners}
        if len(owners) > 1 and len(kinds) > 1:
            for o in owners:
                if o in styles:
                    styles.pop(o)
                    reasons[o] = f"weight tied to {', '.join(x for x in owners if x != o)} which is split differently"
    total = sharded = 0
    replicated: dict[str, str] = {}
    for mod_name, local, param in _owned_params(module):
        total += param.numel()
        if mod_name in styles and sharded_dims(styles[mod_name], local) is not None:
            sharded += param.numel()
        elif mod_name not in styles:
            replicated[mod_name] = reasons.get(mod_name) or structure.reason(mod_name)
    regions = sorted({_parent(n) for n, s in styles.items() if s == ROWWISE})
    return TensorParallelPlan(
        tp_size=tp, source=source, styles=styles, replicated=replicated, regions=tuple(regions),
        norms=structure.norms, stream_embeddings=structure.stream_embeddings, lm_heads=structure.lm_heads,
        blocks=structure.blocks, total_params=total, sharded_params=sharded, warnings=tuple(notes),
    )


def inferred_styles(structure: Structure) -> dict[str, str]:
    """The inferred plan: pairs column/row-parallel, the vocabulary split, heads gathered."""
    kinds = {n: COLWISE for n in structure.column} | {n: ROWWISE for n in structure.row}
    if structure.vocab_embedding is not None:
        kinds[structure.vocab_embedding] = EMBEDDING_ROWWISE
    kinds.update({h: COLWISE_GATHER for h in structure.lm_heads})
    # In group order (layer by layer, q/k/v before o), which is the order the table prints.
    return {m: kinds[m] for members in structure.groups.values() for m in members if m in kinds}


def resolve_tp_plan(
    module: nn.Module, tp_size: int, user_plan: dict[str, str] | None = None, strict: bool = False
) -> TensorParallelPlan:
    """The plan for ``module`` at ``tp_size``: the user's, else the declared one, else inferred.

    Needs no process group and reads only shapes, so it runs on a meta-device model and before
    any collective. Raises a ValueError/TypeError for a bad user plan (unknown module, with
    close matches; unknown style; style that does not fit the module type) and, with
    ``strict``, for any size not divisible by ``tp_size``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise config_error(TypeError, "tensor_parallel_size", tp_size, "must be an int", "pass e.g. tensor_parallel_size=2")
    if tp_size < 1:
        raise config_error(ValueError, "tensor_parallel_size", tp_size, "must be >= 1", "pass e.g. tensor_parallel_size=2")
    if user_plan is not None and not isinstance(user_plan, dict):
        raise config_error(TypeError, "tp_plan", user_plan, "must be a dict of module-name glob -> style", "e.g. {'blocks.*.mlp.fc': 'colwise'}")
    structure = analyse(module)
    notes: list[str] = []
    reasons: dict[str, str] = {}
    declared = declared_plan(module) if not user_plan else {}
    if user_plan:
        source = "user"
        styles = _styles_from_globs(module, dict(user_plan), user=True, notes=notes)
    elif declared:
        source = "declared"
        styles = _styles_from_globs(module, declared, user=False, notes=notes)
    else:
        source = "inferred"
        styles = inferred_styles(structure)
    for name in [n for n, s in styles.items() if s not in SHARDING_STYLES]:
        reasons[name] = "replicate (plan)" if styles[name] == REPLICATE else "norm: sequence-sharded under sequence_parallel"
        if styles.pop(name) == SEQUENCE_PARALLEL and name not in structure.norms:
            structure.norms = tuple(structure.norms) + (name,)
    if source == "inferred":
        groups = {key: [m for m in members if m in styles] for key, members in structure.groups.items()}
    else:
        groups = {}
        for name in styles:
            groups.setdefault(_parent(name) if styles[name] in (COLWISE, ROWWISE) else name, []).append(name)
    return _finalise(module, tp_size, source, styles, groups, reasons, structure, strict, notes)
