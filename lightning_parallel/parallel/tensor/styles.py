"""Tensor-parallel style names: the ones this package applies, the Hugging Face names that map onto
them, and the ones it does not implement (reported, never silently taken). One vocabulary for
the plan, its application and the dry run."""

from __future__ import annotations

import difflib

from lightning_parallel.parallel.errors import config_error

COLWISE = "colwise"
ROWWISE = "rowwise"
COLWISE_GATHER = "colwise_gather_output"
EMBEDDING_ROWWISE = "embedding_rowwise"
# An embedding split along its width (weight dim 1): one column per attention head inside a region.
EMBEDDING_COLWISE = "embedding_colwise"
# A module's own parameters, one row per attention head (GPT-OSS's attention sinks): split with the heads.
HEAD_PARAMETERS = "head_parameters"
ROWWISE_SPLIT_INPUT = "rowwise_split_input"
PACKED_COLWISE = "packed_colwise"
EXPERTS = "moe_tp_experts"
SEQUENCE_PARALLEL = "sequence_parallel"
REPLICATE = "replicate"
STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, EMBEDDING_ROWWISE, EMBEDDING_COLWISE, HEAD_PARAMETERS, ROWWISE_SPLIT_INPUT,
          PACKED_COLWISE, EXPERTS, SEQUENCE_PARALLEL, REPLICATE)
# What a plan stores per module (``packed_colwise`` is stored as ``colwise`` plus ``plan.packed``).
SHARDING_STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, EMBEDDING_ROWWISE, EMBEDDING_COLWISE, HEAD_PARAMETERS, ROWWISE_SPLIT_INPUT,
                   EXPERTS)
STYLE_ALIASES = {
    # Hugging Face names (transformers 5 ``base_model_tp_plan`` values and older ones). Their
    # "local_*" variants leave shapes to the model code; here every sharded layer keeps global
    # shapes inside its block, so they mean the same thing. "rowwise_rep" was a row-parallel layer
    # with a replicated output in transformers 4 and reads a replicated input in transformers 5
    # (no 5.x config uses it); inside a region its input is a DTensor, for which both agree.
    "colwise_rep": COLWISE_GATHER,
    "gather_output": COLWISE_GATHER,
    "rowwise_rep": ROWWISE,
    "local_colwise": COLWISE,
    "local_rowwise": ROWWISE,
    "vocab_parallel": EMBEDDING_ROWWISE,
    "replicated": REPLICATE,
    # Every rank keeps the whole parameter; its gradient is the same on every rank here (the
    # replicated module reads replicated inputs), so HF's extra all-reduce has nothing to add.
    "replicated_with_grad_allreduce": REPLICATE,
}
# Hugging Face styles with no counterpart here (transformers 5): the modules they name fall back
# to the inferred plan, with a note in the plan's warnings.
UNSUPPORTED_HF_STYLES = ("mla_kv_a_proj", "all_reduce", "moe_identity_expert", "local_params",
                         "packed_rowwise")
_LINEAR_STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, ROWWISE_SPLIT_INPUT, PACKED_COLWISE)
_COLUMN_STYLES = (COLWISE, COLWISE_GATHER)
_ROW_STYLES = (ROWWISE, ROWWISE_SPLIT_INPUT)


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
