"""Tensor-parallel pairs read from the dataflow of one recorded forward, not from names.

A column-parallel linear splits its output features across the ``tp`` ranks; the split must
travel, untouched, to the input features of a row-parallel linear, which sums the ranks'
partial products (Megatron's one all-reduce per pair). This module decides which linears can
play which part by following that split through a recorded forward
(:mod:`~lightning_parallel.parallel.tensor.dataflow_record`): each candidate linear's output
carries a *tag* (the split dimension, and into how many equal parts a fused output is packed),
and every ATen op either moves the tag (views, transposes, slices of other dims, elementwise
ops, batched matmuls, attention kernels, norms over other dims), joins the tags of its
operands into one group (``q @ k^T``, ``gate * up``: members split together), or breaks it.
What breaks a split, each with its reason in the plan: a reduction, softmax, norm or matmul
contraction over the split dimension; a reshape that cuts it off whole heads (heads not
divisible by ``tp``, a query/key/value fused with unequal parts, multi-query's single
key/value head); an index, gather or scatter along it; an in-place write of split values into
a whole tensor; an op this module does not know; reaching the model's output. A linear reading
a tagged tensor on its input features is the group's row-parallel member.

Heads and their grouping come from the reshapes the graph performs: ``view(B, T, -1, d)``
moves the split onto the heads when the head count divides by ``tp``; a per-head or per-group
interleaved fused projection (``query_key_value`` viewed as ``(heads, 3, d)``) keeps it there
while the parts are cut along another dim; a ``[q | k | v]`` fused projection cut into equal
parts along the split dim becomes a packed column (each rank holds its slice of every part).
Mixing a split tensor with a whole one of the same extent (a residual, RoPE's ``cos``, a
position bias) is legal: the whole one is sliced locally, as DTensor does.

Groups are decided by a fixed point: propagate all candidates at once, drop every group that
broke (its linears stay whole, so their outputs are whole tensors downstream), pick
non-overlapping groups in execution order (a row-parallel linear is never also a column), and
repeat until nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.parallel.tensor.dataflow_record import LinearCall, Recording, Ref
from lightning_parallel.parallel.tensor.dataflow_rules import Broken, Product, Rules, Tag


@dataclass
class DataflowGroups:
    """The outcome: groups of (columns, rows), packing factors, and why linears stay whole."""

    groups: list[tuple[list[str], list[str]]] = field(default_factory=list)
    packed: dict[str, int] = field(default_factory=dict)
    # Columns whose output packs parts of different sizes (Phi-3's grouped-query [q | k | v]): the sizes.
    packed_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    # Linears whose output reaches the model's output (LM heads, classifiers), from the first pass.
    outputs: set[str] = field(default_factory=set)


class _Pass(Rules):
    """One propagation over the recording with a fixed set of candidate columns."""

    def __init__(self, tp: int, candidates: set[str], packing: dict[str, int | tuple[int, ...]]) -> None:
        self.tp = tp
        self.candidates = candidates
        self.packing = packing
        self.tags: dict[int, Tag] = {}
        self.parent: dict[str, str] = {}
        self.failures: list[tuple[str, str]] = []
        self.rows: list[tuple[str, str, str]] = []  # (group, row linear, origin of the split it reads)
        self.dead: set[str] = set()
        self.pack_requests: dict[str, int | tuple[int, ...]] = {}
        self.features: dict[str, int] = {}
        self.order: list[str] = []
        self.reaching: set[str] = set()

    # --- groups ------------------------------------------------------------------------------
    def find(self, g: str) -> str:
        root = g
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while g != root:  # path compression: later finds are one step
            self.parent[g], g = root, self.parent[g]
        return root

    def union(self, tags: list[Tag]) -> str:
        root = self.find(tags[0].group)
        for t in tags[1:]:
            other = self.find(t.group)
            if other != root:
                self.parent[other] = root
        return root

    def tag(self, ref: Any) -> Tag | None:
        if isinstance(ref, Product):
            return ref.tag
        t = self.tags.get(ref.id) if isinstance(ref, Ref) else None
        return None if t is None or (self.dead and self.find(t.group) in self.dead) else t

    def set(self, ref: Any, tag: Tag | None) -> None:
        if isinstance(ref, Ref):
            if tag is None:
                self.tags.pop(ref.id, None)
            else:
                self.tags[ref.id] = tag

    # --- the walk ----------------------------------------------------------------------------
    def run(self, recording: Recording) -> None:
        for call in recording.calls:
            if isinstance(call, LinearCall):
                self.linear(call)
                continue
            tagged = [t for t in map(self.tag, call.inputs) if t is not None]
            if not tagged:
                for out in call.outs:
                    self.set(out, None)
                continue
            try:
                outs = self.op(call, tagged)
            except Broken as broken:
                self.failures += [(t.group, broken.reason) for t in broken.tags]
                self.kill({self.find(t.group) for t in broken.tags})
                outs = [None] * len(call.outs)
            for ref, tag in zip(call.outs, outs):
                self.set(ref, tag)
        for ref in recording.outputs:
            t = self.tag(ref)
            if t is not None:
                self.failures.append((t.group, "its split output reaches the model's output"))
                self.reaching.add(t.origin)

    def kill(self, roots: set[str]) -> None:
        """A broken group's linears stay whole: from here on none of its tensors is split (``tag``
        reads a dead group's tags as none)."""
        self.dead |= roots

    def linear(self, call: LinearCall) -> None:
        t = self.tag(call.input)
        if t is not None:
            shape = call.input.shape if call.input is not None else ()
            if t.dim == len(shape) - 1 and t.parts == 1:
                self.rows.append((t.group, call.name, t.origin))
            else:
                self.failures.append((t.group, f"reaches `{call.name}` split along dim {t.dim}, not its input features"))
        if call.output is None:
            return
        self.order.append(call.name)
        if call.name not in self.candidates or self.find(call.name) in self.dead:
            self.set(call.output, None)
            return
        parts = self.packing.get(call.name, 1)
        features = call.output.shape[-1] if call.output.shape else 0
        self.features[call.name] = features
        if isinstance(parts, tuple):
            if any(size % self.tp for size in parts):
                self.set(call.output, None)
                self.failures.append((call.name, f"a part of its packed output {parts} is not divisible by tp {self.tp}"))
                return
        elif features % (parts * self.tp):
            self.set(call.output, None)
            self.failures.append((call.name, f"out_features {features} is not divisible by {parts * self.tp} "
                                             f"({parts} part(s) x tp {self.tp})"))
            return
        self.set(call.output, Tag(len(call.output.shape) - 1, parts, call.name, call.name))


def dataflow_groups(recording: Recording, tp: int, candidates: Iterable[str]) -> DataflowGroups:
    """Column/row groups over ``candidates`` (linear names) by the fixed point in the module doc."""
    live = set(candidates)
    packing: dict[str, int | tuple[int, ...]] = {}
    reasons: dict[str, str] = {}
    outputs: set[str] | None = None
    partners: dict[str, str] = {}  # row -> the column whose split it read in the first pass
    for _ in range(64):
        p = _Pass(tp, live, packing)
        p.run(recording)
        if outputs is None:
            outputs = set(p.reaching)
            for _, row, origin in p.rows:
                partners.setdefault(row, origin)
        if p.pack_requests:
            fresh = {k: v for k, v in p.pack_requests.items() if packing.get(k) != v}
            if fresh:
                packing.update(fresh)
                continue
        members: dict[str, list[str]] = {}
        for name in p.order:
            if name in live:
                members.setdefault(p.find(name), [])
                if name not in members[p.find(name)]:
                    members[p.find(name)].append(name)
        broken: set[str] = set()
        for group, reason in p.failures:
            root = p.find(group)
            for m in members.get(root, [group]):
                reasons.setdefault(m, f"as a column-parallel layer: {reason}")
                broken.add(m)
        rows: dict[str, list[str]] = {}
        for group, row, _ in p.rows:
            rows.setdefault(p.find(group), [])
            if row not in rows[p.find(group)]:
                rows[p.find(group)].append(row)
        if broken & live:
            live -= broken
            continue
        chosen: list[tuple[list[str], list[str]]] = []
        used: set[str] = set()
        for root, cols in members.items():  # in execution order of each group's first column
            r = rows.get(root, [])
            if not r:
                for m in cols:
                    reasons.setdefault(m, "its split output reaches no row-parallel linear")
                continue
            if used & (set(cols) | set(r)):
                for m in cols:
                    reasons.setdefault(m, "row-parallel member of another pair")
                continue
            used |= set(cols) | set(r)
            chosen.append((cols, r))
        keep = {m for cols, _ in chosen for m in cols}
        if keep == live:
            result = DataflowGroups(chosen, {k: v for k, v in packing.items() if k in keep and isinstance(v, int) and v > 1},
                                    {k: v for k, v in packing.items() if k in keep and isinstance(v, tuple)},
                                    outputs=outputs or set())
            paired = keep | {m for _, r in chosen for m in r}
            own = dict(reasons)
            for row, origin in partners.items():  # say why a would-be row stays whole: its partner does
                if row not in paired and origin != row and origin in own:
                    reasons[row] = f"reads the split output of `{origin}`, which stays whole ({own[origin]})"
            result.reasons = {k: v for k, v in reasons.items() if k not in paired}
            return result
        live = keep
    raise RuntimeError("tensor-parallel dataflow analysis did not settle")  # pragma: no cover - candidates only shrink
