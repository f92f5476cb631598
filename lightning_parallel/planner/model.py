"""What the layout planner reads from a model: sizes, shapes, and what each rank would hold.

Everything here comes from the module tree of a (meta-device) model and the same planners the
strategy applies: :func:`~lightning_parallel.parallel.tensor.plan.resolve_tp_plan` (with
``strict=True``: a degree that leaves a planned module unsplit is refused, as ``3d`` always
did), :func:`~lightning_parallel.parallel.pipeline.plan.plan_pipeline` (the stage split) and
:func:`~lightning_parallel.parallel.experts.apply.find_expert_modules`. Results are cached per
degree, so searching thousands of layouts asks each planner once per degree.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.experts.apply import find_expert_modules
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import StageStyle
from lightning_parallel.parallel.tensor.infer import head_counts
from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
from lightning_parallel.parallel.tensor.shards import tp_param_bytes

_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k")
_SEQ_ATTRS = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "seq_len")


def first_line(error: Exception) -> str:
    """The rule a nested config error states, without its field prefix and HINT (for reason strings)."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line.split(" is invalid: ", 1)[-1].split(". HINT:", 1)[0][:200]


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds and computes at one (tp, pp, virtual stages): element counts."""

    params: int  # parameters this rank stores (tp split, experts whole: divide by ep later)
    expert_params: int  # of which in expert modules
    matmul_params: int  # weights of Linear layers it runs, per tp rank (2 FLOPs per token each, forward)
    layers: int  # repeated blocks in its stages
    moe_layers: int
    first: bool
    last: bool


@dataclass
class ModelFacts:
    """Sizes and shapes of one model, and cached per-degree plans (see the module docstring)."""

    module: nn.Module
    name: str
    total_params: int
    param_bytes: int  # at the model's own dtype
    n_blocks: int
    block_names: tuple[str, ...]
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    mlp_mats: int  # activations of width ffn a block stores: 2 (fc, act) or 3 (gate, up, product)
    vocab: int
    max_seq: int | None
    expert_counts: tuple[int, ...]
    top_k: int
    dropout: bool = False  # a block has dropout with p > 0 (its masks are stored for backward)
    user_tp_plan: dict[str, str] | None = None
    split_points: list[str] | None = None
    expert_names: tuple[str, ...] | None = None  # found once (a walk of every module; seconds on a 126-block model)
    _tp: dict[int, object] = field(default_factory=dict, repr=False)
    _shares: dict[tuple[int, int, int, str], object] = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.expert_counts)

    @property
    def param_tensors(self) -> int:
        """Parameter tensors: ZeRO-1's ``ZeroRedundancyOptimizer`` broadcasts each one separately."""
        if "_param_tensors" not in self.__dict__:
            self.__dict__["_param_tensors"] = sum(1 for _ in self.module.parameters())
        return self.__dict__["_param_tensors"]

    def tp_reason(self, tp: int) -> str | None:
        """None when the tensor-parallel plan splits every planned module over ``tp``, else why not."""
        entry = self._tp_entry(tp)
        return entry if isinstance(entry, str) else None

    def _tp_entry(self, tp: int) -> tuple[set[str], dict[str, int]] | str:
        """(sharded module names, per-module bytes per rank) at ``tp``, or the reason the plan refuses."""
        if tp not in self._tp:
            if tp == 1:
                self._tp[tp] = (set(), {})
            else:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        plan = resolve_tp_plan(self.module, tp, user_plan=self.user_tp_plan, strict=True)
                    if plan.sharded_params == 0:
                        self._tp[tp] = "the tensor-parallel plan shards no parameter"
                    else:
                        sizes = tp_param_bytes(self.module, plan)["per_module_bytes_per_rank"]
                        self._tp[tp] = (set(plan.styles), dict(sizes))  # type: ignore[call-overload]
                except (ValueError, TypeError) as error:
                    self._tp[tp] = first_line(error)
        return self._tp[tp]  # type: ignore[return-value]

    def shares(self, tp: int, pp: int, virtual: int, style: StageStyle) -> list[RankShare] | str:
        """Per pipeline rank: what it holds and runs; or the reason the tp plan / stage split refuses."""
        key = (tp, pp, virtual, style)
        if key not in self._shares:
            entry = self._tp_entry(tp)
            self._shares[key] = entry if isinstance(entry, str) else self._split(entry[0], entry[1], tp, pp, virtual, style)
        return self._shares[key]  # type: ignore[return-value]

    def _per_module(self, sharded: set[str], sizes: dict[str, int], tp: int) -> dict[str, tuple[int, int, int, int]]:
        """Module name -> (stored params per tp rank, of which expert, Linear weight per tp rank, is an experts module)."""
        if ("per_module", tp) in self._shares:
            return self._shares[("per_module", tp)]  # type: ignore[index, return-value]
        out = self._per_module_uncached(sharded, sizes, tp)
        self._shares[("per_module", tp)] = out  # type: ignore[index]
        return out

    def _per_module_uncached(self, sharded: set[str], sizes: dict[str, int], tp: int) -> dict[str, tuple[int, int, int, int]]:
        owners = _module_params(self.module)
        experts = set(self.expert_names if self.expert_names is not None else find_expert_modules(self.module))
        out: dict[str, tuple[int, int, int, int]] = {}
        for name, mod in self.module.named_modules():
            own, elem = owners.get(name, (0, 4))
            stored = sizes[name] // elem if tp > 1 and name in sizes else own
            is_expert = any(name == e or name.startswith(f"{e}.") for e in experts)
            matmul = 0
            if isinstance(mod, nn.Linear) and not is_expert:
                matmul = -(-mod.weight.numel() // tp) if name in sharded else mod.weight.numel()
            out[name] = (stored, stored if is_expert else 0, matmul, 1 if name in experts else 0)
        return out

    def _split(
        self, sharded: set[str], sizes: dict[str, int], tp: int, pp: int, virtual: int, style: StageStyle
    ) -> list[RankShare] | str:
        per_module = self._per_module(sharded, sizes, tp)
        if pp == 1:
            totals = [sum(v[i] for v in per_module.values()) for i in range(4)]
            return [RankShare(totals[0], totals[1], totals[2], self.n_blocks, totals[3], True, True)]
        try:
            plan = plan_pipeline(self.module, pp, virtual, style=style, split_points=self.split_points)
        except (ValueError, TypeError) as error:
            return first_line(error)
        blocks = set(self.block_names)
        rank_of = {m: s.rank for s in plan.stages for m in s.modules}
        totals = [[0, 0, 0, 0] for _ in range(pp)]
        for name, values in per_module.items():
            owner = name
            while owner and owner not in rank_of:  # the stage module at or above this one
                owner = owner.rpartition(".")[0]
            if owner in rank_of and name:
                for i in range(4):
                    totals[rank_of[owner]][i] += values[i]
        out = []
        for r in range(pp):
            layers = sum(1 for m, rk in rank_of.items() if rk == r and m in blocks)
            t = totals[r]
            out.append(RankShare(t[0], t[1], t[2], layers, t[3], r == 0, r == pp - 1))
        return out


def _module_params(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Module name -> (elements of the parameters it owns first, element size); shared ones once."""
    seen: set[int] = set()
    out: dict[str, tuple[int, int]] = {}
    for name, mod in module.named_modules():
        count, elem = 0, 4
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            count += p.numel()
            elem = p.element_size()
        if count:
            out[name] = (count, elem)
    return out


def _int_attr(holders: list[object], names: tuple[str, ...]) -> int | None:
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def model_facts(module: nn.Module, *, tp_plan: dict[str, str] | None = None, split_points: list[str] | None = None) -> ModelFacts:
    """Read sizes and shapes from ``module`` (any device; meta is the point)."""
    unique = {id(p): p for p in module.parameters()}.values()
    total = sum(p.numel() for p in unique)
    nbytes = sum(p.numel() * p.element_size() for p in unique)
    blocks = find_repeated_blocks(module)
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    vocab_emb = max(embeddings, key=lambda m: m.num_embeddings, default=None)
    linears = [m for _, b in blocks[:1] for m in b.modules() if isinstance(m, nn.Linear)]
    hidden = vocab_emb.embedding_dim if vocab_emb is not None else (linears[0].in_features if linears else 1)
    heads = kv = None
    for _, block in blocks[:1]:
        for sub in block.modules():
            h, k = head_counts(sub)
            if h is not None:
                heads, kv = h, k
                break
    configs = [getattr(m, "config", None) for m in module.modules() if getattr(m, "config", None) is not None][:1]
    wide = [m for m in linears if m.in_features == hidden and m.out_features > hidden]
    ffn = max((m.out_features for m in wide), default=4 * hidden)
    mlp_mats = 1 + sum(1 for m in wide if m.out_features == ffn)
    experts = find_expert_modules(module)
    counts = tuple(next(sub.parameters(recurse=False)).shape[0] for sub in experts.values())
    holders: list[object] = [module, *configs]
    for name in experts:
        parent = name.rpartition(".")[0]
        holders += [module.get_submodule(parent)] if parent else []
        holders += [m for m in module.get_submodule(parent).modules()] if parent else []
    top_k = _int_attr(holders, _TOPK_ATTRS) or 2 if counts else 1
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for _, b in blocks[:1] for m in b.modules()) or any(
        isinstance(getattr(c, n, None), float) and getattr(c, n) > 0 for c in configs
        for n in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "dropout"))
    if counts and not any(c >= 1 for c in counts):
        counts = ()
    return ModelFacts(
        module=module, name=type(module).__name__, total_params=total, param_bytes=nbytes,
        n_blocks=len(blocks), block_names=tuple(n for n, _ in blocks), hidden=hidden,
        heads=heads or max(1, hidden // 64), kv_heads=kv or heads or max(1, hidden // 64), ffn=ffn,
        mlp_mats=max(2, mlp_mats) if blocks else 2, vocab=vocab_emb.num_embeddings if vocab_emb is not None else 0,
        max_seq=_int_attr([module, *configs], _SEQ_ATTRS), expert_counts=counts, top_k=top_k, dropout=dropout,
        user_tp_plan=dict(tp_plan) if tp_plan else None, split_points=list(split_points) if split_points else None,
        expert_names=tuple(experts),
    )


__all__ = ["ModelFacts", "RankShare", "first_line", "model_facts"]
