"""Inference of a tensor-parallel layout: which linears pair up, where the vocabulary is.

Separate from the plan (:mod:`lightning_parallel.parallel.tensor.plan`) because it answers another
question: not "which style does a module get" (precedence, user globs, divisibility, bytes) but
"which linears form a column/row pair, where is the vocabulary, which modules sit on the
residual stream".

Pairs come from the dataflow wherever a forward can be recorded
(:mod:`~lightning_parallel.parallel.tensor.dataflow`): a Hugging Face model with its own dummy
inputs, or any module with Lightning's ``example_input_array``; it runs on meta or fake tensors,
so it works on a model built under ``empty_init``. Each pair's *region*, the module whose
forward sees its split tensors, is the smallest module holding all its members (BERT's
``attention``, which holds ``self.query`` and ``output.dense``).

Where no forward can be recorded, names and shapes decide, and the plan says so: attention by
role names (``q_proj``, ``wq``, ...) or, when the parent declares a head count, by shape and
order; a feed-forward pair by an ``H -> F`` linear (or gate and up) registered before an
``F -> H`` one, or by execution order in an ``nn.Sequential``. The plan turns these roles into styles.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.parallel.tensor.dataflow import dataflow_groups
from lightning_parallel.parallel.tensor.dataflow_record import LinearCall, Recording, example_call, record_forward
from lightning_parallel.parallel.tensor.experts import experts_reason
from lightning_parallel.parallel.tensor.fused import features, is_linear_like

_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU,
    nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardtanh, nn.Hardsigmoid,
)
_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads", "n_kv")
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "d_head")
_ROLE_NAMES = {
    "q": ("q", "q_proj", "query", "wq", "to_q", "q_lin"),
    "k": ("k", "k_proj", "key", "wk", "to_k", "k_lin"),
    "v": ("v", "v_proj", "value", "wv", "to_v", "v_lin"),
    "o": ("o", "o_proj", "out_proj", "proj", "c_proj", "wo", "out", "dense", "to_out", "out_lin", "output"),
}
# Fused q/k/v projections laid out as [q | k | v] along the output features (GPT-2's ``c_attn``,
# Phi-3's ``qkv_proj``, Baichuan's ``W_pack``). GPT-NeoX's ``query_key_value`` is laid out per
# head ([q_h k_h v_h] for each head), so a plain split of it already gives whole heads.
_PACKED_QKV = ("c_attn", "qkv_proj", "w_pack", "wqkv")
_PER_HEAD_QKV = ("query_key_value",)
_PACKED_GATE_UP = ("gate_up_proj", "w12", "gate_up")


def _int_attr(obj: nn.Module, names: tuple[str, ...]) -> int | None:
    """First positive int among ``names`` on the module, then on its ``config`` (HF layout)."""
    for holder in (obj, getattr(obj, "config", None)):
        for name in names if holder is not None else ():
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def head_counts(module: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) a module declares by attribute, None when it does not."""
    return _int_attr(module, _HEAD_ATTRS), _int_attr(module, _KV_ATTRS)


@dataclass
class Structure:
    """What the module tree says without running it: groups to shard and the residual stream.

    ``column`` are the first linears of each pair (they may split their outputs), ``row`` the
    second (they split their inputs and sum), ``groups`` the members that must be split
    together, keyed by the parent module (``parent#mlpN`` for a feed-forward pair,
    ``#vocab`` for the vocabulary embedding and the LM heads reading its width).
    """

    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    vocab_embedding: str | None = None
    groups: dict[str, list[str]] = field(default_factory=dict)
    norms: tuple[str, ...] = ()
    stream_embeddings: tuple[str, ...] = ()
    lm_heads: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    roles: dict[str, str] = field(default_factory=dict)
    packed: dict[str, int] = field(default_factory=dict)
    packed_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # unequal parts (dataflow only)
    experts: list[str] = field(default_factory=list)
    # Embeddings one column per attention head (T5's relative position bias): split with the heads.
    head_embeddings: list[str] = field(default_factory=list)
    # Attention modules whose own parameters are one row per head (GPT-OSS's sinks): split with the heads.
    head_parameters: list[str] = field(default_factory=list)
    # Row-parallel linear -> the module whose forward sees its pair's split tensors (its parent
    # where names decided; the members' smallest common module where the dataflow did).
    region_of: dict[str, str] = field(default_factory=dict)
    # How pairs were found, per traced root ("" = the whole model): "dataflow", or why not.
    method: dict[str, str] = field(default_factory=dict)

    def reason(self, name: str) -> str:
        """Why a module that owns parameters is not sharded, for the report."""
        return self.roles.get(name, "no column/row-parallel partner found")


def _fused_attention(parent: nn.Module, lins: list[tuple[str, nn.Module]]) -> tuple[str, str, int] | None:
    """(fused qkv child, output child, split factor) of an attention with one fused q/k/v projection.

    The split factor is 3 for a ``[q | k | v]`` layout with equal parts (split per part, each
    rank gets whole heads of each), 1 for a per-head layout. Grouped-query ``[q | k | v]`` with
    unequal parts has no such placement and is not matched (it stays whole, with its reason).
    """
    heads = head_counts(parent)[0] or _int_attr(parent, _HEAD_DIM_ATTRS)
    if not heads or len(lins) != 2:
        return None
    (fn, fused), (on, out) = lins
    if fn.lower() in _ROLE_NAMES["o"] or on.lower() not in _ROLE_NAMES["o"]:
        (fn, fused), (on, out) = (on, out), (fn, fused)
    f_in, f_out = features(fused)
    o_in, _ = features(out)
    if on.lower() not in _ROLE_NAMES["o"] or f_out != 3 * o_in:
        return None
    if fn.lower() in _PACKED_QKV:
        return fn, on, 3
    if fn.lower() in _PER_HEAD_QKV:
        return fn, on, 1
    return None


def _attention(parent: nn.Module, lins: list[tuple[str, nn.Module]]) -> dict[str, str] | None:
    """role -> child name for q/k/v/o, found by name, else by shape and order, else None.

    Shape and order: q, k, v are the first three linears reading the same width, with k and v
    of equal width dividing q's (grouped-query attention has fewer k/v heads); o is a later
    linear reading q's width. Without role names, a head-count attribute must say "attention".
    """
    by_name = {}
    for role, names in _ROLE_NAMES.items():
        hit = [local for local, _ in lins if local.lower() in names]
        if hit:
            by_name[role] = hit[0]
    found = by_name if len(by_name) == 4 else None
    if found is None and (head_counts(parent)[0] or _int_attr(parent, _HEAD_DIM_ATTRS)):
        for i in range(len(lins) - 3):
            (qn, q), (kn, k), (vn, v) = lins[i], lins[i + 1], lins[i + 2]
            outs = [(on, o) for on, o in lins[i + 3:] if features(o)[0] == features(q)[1]]
            if features(q)[0] == features(k)[0] == features(v)[0] and outs:
                found = {"q": qn, "k": kn, "v": vn, "o": outs[-1][0]}
                break
    if found is None:
        return None
    mods = dict(lins)
    (q_in, q_out), (k_in, k_out), (v_in, v_out), (o_in, _) = (features(mods[found[r]]) for r in "qkvo")
    shapes_ok = q_in == k_in == v_in and k_out == v_out and q_out % k_out == 0 and o_in == q_out
    return found if shapes_ok else None


def _mlp_groups(parent: nn.Module, lins: list[tuple[str, nn.Module]], used: set[str]) -> list[tuple[list[str], str, int]]:
    """([column-parallel children], row-parallel child) pairs around an elementwise op.

    In an ``nn.Sequential`` the order of children is the order of execution, so a Linear, any
    elementwise modules, then a Linear reading its width form a pair. Elsewhere a pair is
    ``H -> F`` linears (one, or gate and up) registered before an ``F -> H`` linear, or a fused
    ``H -> 2F`` gate/up (by name) before an ``F -> H`` one. The third element is the split factor
    of the column-parallel output (2 for a packed gate/up, else 1).
    """
    groups: list[tuple[list[str], str, int]] = []
    if isinstance(parent, nn.Sequential):
        children = list(parent.named_children())
        i = 0
        while i < len(children):
            name, first = children[i]
            j = i + 1
            while j < len(children) and isinstance(children[j][1], _ELEMENTWISE):
                j += 1
            if (
                is_linear_like(first) and j < len(children)
                and is_linear_like(children[j][1]) and features(children[j][1])[0] == features(first)[1]
            ):
                groups.append(([name], children[j][0], 1))
                i = j + 1
            else:
                i += 1
        return groups
    for d_pos, (dn, down) in enumerate(lins):
        if dn in used:
            continue
        d_in, d_out = features(down)
        ups = [un for un, up in lins[:d_pos] if un not in used and features(up) == (d_out, d_in)]
        if ups:
            used.update(ups + [dn])
            groups.append((ups, dn, 1))
            continue
        packed = [un for un, up in lins if un not in used and un.lower() in _PACKED_GATE_UP
                  and features(up) == (d_out, 2 * d_in)]
        if packed:
            used.update(packed[:1] + [dn])
            groups.append((packed[:1], dn, 2))
    return groups


def _common_module(names: list[str]) -> str:
    """The smallest module holding every named one (their longest common dotted prefix)."""
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _dataflow_roots(module: nn.Module) -> list[tuple[str, nn.Module, tuple[tuple, dict]]]:
    """Outermost submodules (the root included) with inputs to record a forward with, and those inputs."""
    roots: list[tuple[str, nn.Module, tuple[tuple, dict]]] = []
    for name, mod in module.named_modules():
        if any(name == r or name.startswith(f"{r}.") or r == "" for r, _, _ in roots):
            continue
        call = example_call(mod)
        if call is not None:
            roots.append((name, mod, call))
    return roots


# One recording per model, or why it failed (the planner resolves a plan per candidate tp degree).
_RECORDINGS: weakref.WeakKeyDictionary[nn.Module, Recording | str] = weakref.WeakKeyDictionary()


def _recording(sub: nn.Module, call: tuple[tuple, dict]) -> Recording | str:
    if sub not in _RECORDINGS:
        try:
            _RECORDINGS[sub] = record_forward(sub, *call)
        except Exception as error:  # noqa: BLE001 - any failure leaves this root to names and shapes
            _RECORDINGS[sub] = f"recording a forward failed: {type(error).__name__}: {str(error)[:120]}"
    return _RECORDINGS[sub]


def recorded_linear_inputs(module: nn.Module) -> dict[str, set[int]]:
    """Linear layer FQN (under ``module``) -> the ids of the tensors it read in the forward recorded
    when its plan was inferred; nothing is recorded here (a root not recorded yet is left out).

    Two layers with a common id read the same tensor, so their partial input gradients can be
    summed before one reduction: what the Megatron minimum of ``testing/comm_counts.py`` counts."""
    out: dict[str, set[int]] = {}
    for root, sub, _ in _dataflow_roots(module):
        recording = _RECORDINGS.get(sub)
        if not isinstance(recording, Recording):
            continue
        prefix = f"{root}." if root else ""
        for call in recording.calls:
            if isinstance(call, LinearCall) and call.input is not None:
                out.setdefault(prefix + call.name, set()).add(call.input.id)
    return out


def _apply_dataflow(module: nn.Module, st: Structure, tp: int) -> None:
    """Replace the name-found pairs under each recordable root by the dataflow's (module doc)."""
    for root, sub, call in _dataflow_roots(module):
        prefix = f"{root}." if root else ""
        recording = _recording(sub, call)
        if isinstance(recording, str):
            st.method[root] = f"names and shapes ({recording})"
            continue
        linears = [n for n, m in sub.named_modules() if is_linear_like(m)]
        found = dataflow_groups(recording, tp, linears)
        st.method[root] = "dataflow"
        under = [g for g, members in st.groups.items() if g != "#vocab" and not g.endswith("#experts")
                 and all(m.startswith(prefix) for m in members)]
        for g in under:
            for m in st.groups.pop(g):
                for kind in (st.column, st.row):
                    if m in kind:
                        kind.remove(m)
                st.packed.pop(m, None)
                st.packed_sizes.pop(m, None)
        blocks = [b for b in st.blocks if not (b == root or b.startswith(prefix))]
        for n, (cols, rows) in enumerate(found.groups):
            cols, rows = [prefix + c for c in cols], [prefix + r for r in rows]
            region = _common_module(cols + rows)
            while region and isinstance(module.get_submodule(region), (nn.ModuleList, nn.ModuleDict)):
                region = region.rpartition(".")[0]  # a container has no forward of its own to run as the region
            st.column += cols
            st.row += rows
            st.groups[f"{region}#tp{n}"] = cols + rows
            st.region_of.update({r: region for r in rows})
            if region not in blocks:
                blocks.append(region)
        # An LM head found by shape is one only if its output reaches the model's output.
        heads = tuple(h for h in st.lm_heads if not h.startswith(prefix) or h[len(prefix):] in found.outputs)
        if heads != st.lm_heads and "#vocab" in st.groups:
            st.groups["#vocab"] = [m for m in st.groups["#vocab"] if m not in st.lm_heads or m in heads]
            st.lm_heads = heads
        st.packed.update({prefix + k: v for k, v in found.packed.items()})
        st.packed_sizes.update({prefix + k: v for k, v in found.packed_sizes.items()})
        st.roles.update({prefix + k: v for k, v in found.reasons.items()})
        st.blocks = tuple(blocks)


def analyse(module: nn.Module, tp_size: int = 2) -> Structure:
    """Infer a plan: attention and MLP pairs (from the dataflow where a forward can be recorded,
    see the module doc), vocab embedding and head, norms, experts. ``tp_size`` decides which
    reshapes keep whole heads on every rank."""
    st = Structure()
    modules = dict(module.named_modules())
    blocks: list[str] = []
    for pname, parent in modules.items():
        prefix = f"{pname}." if pname else ""
        if any(p.ndim == 3 for p in parent.parameters(recurse=False)):
            reason = experts_reason(parent)
            if reason is None:
                st.experts.append(pname)
                st.groups[f"{pname}#experts"] = [pname]
            else:
                st.roles[pname] = reason
        if isinstance(parent, nn.MultiheadAttention):
            st.roles[pname] = (
                "nn.MultiheadAttention: no tensor-parallel split of its fused in_proj_weight (used inside "
                "F.multi_head_attention_forward) is implemented; kept whole"
            )
        lins = [(n, c) for n, c in parent.named_children() if is_linear_like(c)]
        if not lins:
            continue
        used: set[str] = set()
        attn = _attention(parent, lins)
        fused = _fused_attention(parent, lins) if attn is None else None
        if fused is not None:
            fn, on, factor = fused
            st.column.append(prefix + fn)
            st.row.append(prefix + on)
            st.groups[pname] = [prefix + fn, prefix + on]
            if factor > 1:
                st.packed[prefix + fn] = factor
            used.update((fn, on))
            blocks.append(pname)
        if attn is not None:
            members = [prefix + attn[r] for r in "qkv"] + [prefix + attn["o"]]
            st.column += members[:3]
            st.row.append(members[3])
            st.groups[pname] = members
            used.update(attn.values())
            blocks.append(pname)
        for n, (ups, down, factor) in enumerate(_mlp_groups(parent, lins, used)):
            members = [prefix + u for u in ups] + [prefix + down]
            if factor > 1:
                st.packed[members[0]] = factor
            st.column += members[:-1]
            st.row.append(members[-1])
            st.groups[f"{pname}#mlp{n}"] = members
            if pname not in blocks:
                blocks.append(pname)
    st.blocks = tuple(blocks)
    inside = tuple(f"{b}." for b in blocks if b)
    paired = set(st.column) | set(st.row)
    embeddings = [(n, m) for n, m in modules.items() if isinstance(m, nn.Embedding)]
    heads = [
        (e_name, n) for n, m in modules.items() for e_name, e in embeddings
        if isinstance(m, nn.Linear) and n not in paired and not n.startswith(inside)
        and (m.in_features, m.out_features) == (e.embedding_dim, e.num_embeddings)
    ]
    if heads or embeddings:
        vocab_name = max(heads or [(n, "") for n, _ in embeddings], key=lambda h: modules[h[0]].num_embeddings)[0]
        hidden = modules[vocab_name].embedding_dim
        st.vocab_embedding = vocab_name
        st.lm_heads = tuple(h for e, h in heads if e == vocab_name)
        st.groups["#vocab"] = [vocab_name, *st.lm_heads]
        st.stream_embeddings = tuple(n for n, e in embeddings if e.embedding_dim == hidden)
        st.roles.update({n: "position/extra embedding" for n in st.stream_embeddings if n != vocab_name})
    norms = []
    for name, mod in modules.items():
        params = list(mod.parameters(recurse=False))
        if "norm" in type(mod).__name__.lower() and params and all(p.dim() == 1 for p in params):
            if not name.startswith(inside):
                norms.append(name)
            st.roles[name] = "norm (sequence-sharded under sequence_parallel)"
    st.norms = tuple(norms)
    if tp_size > 1:
        _apply_dataflow(module, st, tp_size)
    _per_head_parts(module, st)
    return st


def _per_head_parts(module: nn.Module, st: Structure) -> None:
    """Parameters of an attention region laid out one per head join the region's group, split along
    the heads as its projections are, or kept whole with them: an embedding inside the region as wide
    as its head count (T5's relative position bias: a value per head and distance bucket,
    ``embedding_colwise``), and the region module's own parameters when each has the head count as
    its leading dim (GPT-OSS's attention sinks, ``head_parameters``).

    Why: kept whole, each was cut to the rank's heads where the attention read it and its gradient
    gathered back (T5: 1.19x, then 1.10x the Megatron minimum with one gather per stack; GPT-OSS's
    sinks, concatenated to the split scores, gathered forward and backward: 1.36x). Split, each rank
    uses its own heads' rows, and their gradients stay on the rank."""
    taken = {st.vocab_embedding, *st.stream_embeddings}
    for members in st.groups.values():
        for region in sorted({st.region_of.get(m) for m in members} - {None, ""}):
            heads = head_counts(module.get_submodule(region))[0]
            if heads is None:
                continue
            own = list(module.get_submodule(region).parameters(recurse=False))
            found = [(region, st.head_parameters)] if own and all(p.ndim >= 1 and p.shape[0] == heads for p in own) else []
            found += [(name, st.head_embeddings) for name, emb in module.get_submodule(region).named_modules(prefix=region)
                      if isinstance(emb, nn.Embedding) and name not in taken and emb.embedding_dim == heads]
            for name, kind in found:
                if name not in taken:
                    taken.add(name)
                    members.append(name)
                    kind.append(name)
                    st.roles.pop(name, None)
