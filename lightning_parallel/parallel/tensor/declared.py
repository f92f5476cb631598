"""Plans a model declares the Hugging Face way (``_tp_plan``, ``config.base_model_tp_plan``), read
as module-name globs, and where the inferred dataflow can do the same split with less communication.

Separate from :mod:`~lightning_parallel.parallel.tensor.plan` (which decides precedence and checks the
result) because this is the one place that speaks transformers' vocabulary of style names and globs.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.experts import experts_layout
from lightning_parallel.parallel.tensor.fused import is_linear_like
from lightning_parallel.parallel.tensor.styles import (
    COLWISE,
    COLWISE_GATHER,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    EXPERTS,
    HEAD_PARAMETERS,
    PACKED_COLWISE,
    REPLICATE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SEQUENCE_PARALLEL,
    UNSUPPORTED_HF_STYLES,
    _LINEAR_STYLES,
    canonical_style,
)


def fold_layer_index(name: str) -> str:
    """``blocks.3.attn.q`` -> ``blocks.*.attn.q``: one table row per repeated layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _glob_match(pattern: str, name: str) -> bool:
    """Segment-wise glob, as ``torch.distributed.tensor.parallel.parallelize_module`` matches."""
    pat, parts = pattern.split("."), name.split(".")
    return len(pat) == len(parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(pat, parts))


def generalised(names: list[str]) -> list[str]:
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


def _fits(style: str, mod: nn.Module) -> bool:
    if style in _LINEAR_STYLES:
        return is_linear_like(mod)
    if style in (EMBEDDING_ROWWISE, EMBEDDING_COLWISE):
        return isinstance(mod, nn.Embedding)
    if style == HEAD_PARAMETERS:
        return any(True for _ in mod.parameters(recurse=False))
    if style == EXPERTS:
        return experts_layout(mod) is not None
    return style in (SEQUENCE_PARALLEL, REPLICATE)


def styles_from_globs(
    module: nn.Module, globs: dict[str, str], *, user: bool, notes: list[str], packed: dict[str, int]
) -> tuple[dict[str, str], set[str]]:
    """Expand glob -> style into FQN -> canonical style; user mistakes raise, declared ones warn.

    Returns the styles and every module a declared entry named (also the ones it could not
    style), so the inferred plan does not fill in what the model's own plan spoke about.
    ``packed_colwise`` becomes ``colwise`` with split factor 2 in ``packed``. A declared entry
    naming a *parameter* of an experts module (HF writes ``experts.gate_up_proj: packed_colwise``
    next to ``experts: moe_tp_experts``) is part of that module's style.
    """
    modules = dict(module.named_modules())
    names = [n for n in modules if n]
    params = {n for n, _ in module.named_parameters()}
    styles: dict[str, str] = {}
    named: set[str] = set()
    ordered = sorted(globs.items(), key=lambda kv: kv[0] in modules)  # exact names applied last
    for pattern, raw_style in ordered:
        where = f"tp_plan[{pattern!r}]"
        if not isinstance(pattern, str):
            raise config_error(TypeError, "tp_plan", pattern, "plan keys are module-name globs (str)", "use e.g. 'layers.*.mlp.up_proj'")
        matched = [n for n in names if _glob_match(pattern, n)]
        if not user and isinstance(raw_style, str) and raw_style.strip().lower() in UNSUPPORTED_HF_STYLES:
            named.update(matched)
            if matched:
                notes.append(f"declared plan entry {pattern!r}: Hugging Face style {raw_style!r} has no counterpart here; "
                             "its modules follow the inferred plan")
            continue
        try:
            style = canonical_style(raw_style, where=where)
        except (TypeError, ValueError):
            if user:
                raise
            named.update(matched)
            notes.append(f"declared plan entry {pattern!r}: style {raw_style!r} is not supported; its modules follow the inferred plan")
            continue
        if not matched:
            if not user and any(_glob_match(pattern, n) for n in params):
                continue  # a parameter of an experts module: its module's moe_tp_experts entry covers it
            if user:
                close = difflib.get_close_matches(pattern, generalised(names), n=5, cutoff=0.5)
                raise config_error(
                    ValueError, "tp_plan", pattern, f"no module matches this name (close matches: {close or 'none'})",
                    "use module names as in model.named_modules(); '*' matches one dotted component",
                )
            notes.append(f"declared plan entry {pattern!r} matches no module; ignored")
            continue
        for name in matched:
            mod = modules[name]
            named.add(name)
            style_here = EMBEDDING_ROWWISE if style == ROWWISE and isinstance(mod, nn.Embedding) else style
            if not _fits(style_here, mod):
                msg = (f"style {style_here!r} needs an nn.Linear or Conv1D (colwise/rowwise), an nn.Embedding "
                       f"(embedding_rowwise) or a Hugging Face experts module (moe_tp_experts), got {type(mod).__name__}")
                if user:
                    raise config_error(ValueError, where, name, msg, "choose a style that fits the module type, or 'replicate'")
                notes.append(f"declared plan: module {name!r}: {msg}; left replicated")
                continue
            if style_here == PACKED_COLWISE:
                style_here = COLWISE
                packed[name] = 2
            styles[name] = style_here
    return styles, named


def upgrade_gathered_pairs(
    styles: dict[str, str], inferred: dict[str, str], groups: dict[str, list[str]], inferred_packed: dict[str, int],
    packed: dict[str, int], notes: list[str],
) -> list[str]:
    """Run a declared ``colwise_gather_output`` -> ``rowwise_split_input`` pair as ``colwise`` -> ``rowwise``
    where the dataflow pairs exactly those modules; return the modules changed.

    Why: Hugging Face declares packed projections this way (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``) because its local-tensor layers cannot cut a packed output per part: the
    output is gathered whole, then sliced again before the row-parallel layer, an all-gather per
    region in forward and another in backward. Gather-then-split is the identity on the values, so
    the pair computes what a column/row pair computes; here a packed output is split per part
    (:mod:`~lightning_parallel.parallel.tensor.fused`), so the pair runs at the Megatron minimum.
    ``groups``: the inferred groups (members of one column/row region); any other declared style
    in a group leaves it as declared.
    """
    expected = {COLWISE: COLWISE_GATHER, ROWWISE: ROWWISE_SPLIT_INPUT}
    changed: list[str] = []
    for members in groups.values():
        if not any(inferred.get(m) == ROWWISE for m in members) or not any(inferred.get(m) == COLWISE for m in members):
            continue
        if any(m not in styles or styles[m] != expected.get(inferred.get(m, ""), None) for m in members):
            continue
        for m in members:
            styles[m] = inferred[m]
            if m in inferred_packed:
                packed[m] = inferred_packed[m]
        changed += members
    if changed:
        notes.append(f"declared colwise_gather_output/rowwise_split_input pairs run as colwise/rowwise (same values, "
                     f"no gather between them): {generalised(changed)[:4]}")
    return changed
