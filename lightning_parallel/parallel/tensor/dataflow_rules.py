"""The per-op rules of the tensor-parallel dataflow analysis: where a split goes through each ATen op.

Separate from the walk and the fixed point (:mod:`~lightning_parallel.parallel.tensor.dataflow`,
whose docstring says what a split is and which ops break one) because this is the table that
grows with the ops models use. Each rule takes a call's bound arguments (tensors as
:class:`~lightning_parallel.parallel.tensor.dataflow_record.Ref`) and returns its outputs'
tags, or raises :class:`Broken` naming the split groups and the reason, which the plan reports
beside each linear kept whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_parallel.compat import op_arguments
from lightning_parallel.parallel.tensor.dataflow_record import OpCall, Ref


@dataclass(frozen=True)
class Tag:
    """A split tensor dimension: ``dim``, packed into ``parts`` equal parts, of group ``group``,
    derived from the output of linear ``origin``."""

    dim: int
    parts: int | tuple[int, ...]  # equal parts, or the sizes of unequal ones
    group: str
    origin: str


class Broken(Exception):
    """The op breaks the split of these tags (raised inside a rule, recorded by the pass)."""

    def __init__(self, tags: Iterable[Tag], reason: str) -> None:
        super().__init__(reason)
        self.tags = list(tags)
        self.reason = reason


_VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as"}
_SAME = {"clone", "contiguous", "detach", "alias", "_to_copy", "lift_fresh", "lift_fresh_copy", "fill", "zero",
         "masked_fill", "where", "native_dropout", "dropout", "clamp", "clamp_min", "clamp_max", "copy",
         "_assert_tensor_metadata", "type_as", "to"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "std_mean", "prod", "logsumexp",
           "linalg_vector_norm", "norm", "argmax", "argmin", "any", "all", "count_nonzero", "nansum"}
_ALONG = {"_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax", "cumsum", "cumprod", "sort", "topk", "_softmax_backward_data",
          "roll", "flip", "cummax", "cummin"}
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_fused_attention_overrideable", "scaled_dot_product_attention"}
_NO_DATA = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "empty_like", "zeros_like", "ones_like",
            "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "rand_like", "randn_like", "_local_scalar_dense_meta"}


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Argument name -> value for an ATen call, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(op_arguments(func)):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and destination dims whose sizes multiply to the same extent."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, a, b = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a, i = a * src[i], i + 1
                gi.append(i - 1)
            elif j < len(dst):
                b, j = b * dst[j], j + 1
                gj.append(j - 1)
            else:
                break
        groups.append((gi, gj))
    if groups:
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


@dataclass(frozen=True)
class Product:
    """The matmul half of a fused ``input + a @ b`` op, as an operand of its pointwise half."""

    ref: Ref
    tag: Tag | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape


def refs(value: Any) -> list[Any]:
    if isinstance(value, Product):
        return [value] if value.tag is not None else []
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in refs(v)]
    return []



class Rules:
    """The op rules; the walk (:class:`~lightning_parallel.parallel.tensor.dataflow._Pass`) supplies
    ``tp``, the tags by tensor (``tag``), the group union (``union``) and ``pack_requests``."""

    tp: int
    pack_requests: dict[str, int | tuple[int, ...]]
    features: dict[str, int]  # output features of each linear seen so far

    def tag(self, ref: Any) -> Tag | None:  # pragma: no cover - the walk's
        raise NotImplementedError

    def union(self, tags: list[Tag]) -> str:  # pragma: no cover - the walk's
        raise NotImplementedError

    def op(self, call: OpCall, tagged: list[Tag]) -> list[Tag | None]:
        """Tags of ``call``'s outputs; raises :class:`Broken` where the split cannot pass."""
        func = call.func
        name = func.overloadpacket.__name__.rstrip("_") if hasattr(func, "overloadpacket") else str(func)
        bound = bind(func, call.args, call.kwargs)
        first = call.outs[0] if call.outs else None
        if name in _NO_DATA or all(o is None for o in call.outs):  # no tensor out: device, sizes, item()
            return [None] * len(call.outs)
        if name in _VIEWS:
            return [self.view(bound, first, tagged)]
        if name in ("expand", "broadcast_to"):
            src = bound["self"]
            t = self.tag(src)
            return [t and Tag(t.dim + len(first.shape) - len(src.shape), t.parts, t.group, t.origin)]
        if name in ("transpose", "swapaxes", "t", "permute", "movedim"):
            return [self.permute(name, bound, first)]
        if name in ("slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "tensor_split"):
            return self.cut(name, bound, call.outs)
        if name in ("cat", "concat", "stack"):
            return [self.cat(name, bound, first)]
        if name in ("mm", "bmm", "matmul"):
            return [self.matmul(bound, first)]
        if name in ("baddbmm", "addmm", "addbmm"):  # input + batch1 @ batch2 (ALiBi's bias + q @ k^T)
            product = self.matmul({"self": bound.get("batch1", bound.get("mat1")),
                                   "mat2": bound.get("batch2", bound.get("mat2"))}, first)
            return self.pointwise(name, {"self": bound["self"], "product": Product(first, product)}, call.outs, tagged)
        if name == "index":
            return [self.index(bound, first, tagged)]
        if name in _SDPA:
            return self.sdpa(bound, call.outs)
        if name in _REDUCE:
            return self.reduce(name, bound, call.outs)
        if name in _ALONG:
            t = self.tag(bound.get("self"))
            d = bound.get("dim")
            if t is None or (isinstance(d, int) and _dim(d, len(bound["self"].shape)) != t.dim):
                return [t if o is not None and t is not None and o.shape == bound["self"].shape else None for o in call.outs]
            raise Broken(tagged, f"`aten.{name}` runs along the split dimension")
        if name in ("native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"):  # group norms: no rule
            x = bound.get("input")
            t = self.tag(x)
            normed = len(bound.get("normalized_shape") or ()) or 1
            if t is not None and t.dim < len(x.shape) - normed and not [w for w in tagged if w is not t]:
                return [t if o is not None and len(o.shape) == len(x.shape) and o.shape[t.dim] == x.shape[t.dim] else None
                        for o in call.outs]
            raise Broken(tagged, f"`aten.{name}` normalises over the split dimension")
        if name in ("index_select", "gather", "constant_pad_nd", "pad", "triu", "tril"):
            return [self.keep_unless(name, bound, first, tagged)]
        if torch.Tag.pointwise in getattr(func, "tags", ()) or name in _SAME:
            return self.pointwise(name, bound, call.outs, tagged)
        raise Broken(tagged, f"`aten.{name}` has no tensor-parallel rule here")

    # --- rules -------------------------------------------------------------------------------
    def view(self, bound: dict, out: Ref, tagged: list[Tag]) -> Tag | None:
        """Follow the split through a reshape.

        The split dim is read as ``(outer, T, inner)``: ``outer`` counts the packed parts and
        the dims merged in front of it (a batch merged with the heads for a batched matmul),
        ``T`` the extent split across ranks. The output dim that starts where ``outer`` ends
        takes the split: whole when it holds ``T`` (times inner dims), else its leading part
        when it divides ``T`` (the heads of ``view(B, S, heads, d)``), which must divide by ``tp``.
        """
        src = bound.get("self") if "self" in bound else bound.get("input")
        t = self.tag(src)
        if t is None:
            return None
        if isinstance(t.parts, tuple):
            raise Broken([t], f"a reshape of a fused output of unequal parts {t.parts} before it is cut into them")
        for gi, gj in view_groups(src.shape, out.shape):
            if t.dim not in gi:
                continue
            outer = t.parts
            for i in gi[: gi.index(t.dim)]:
                outer *= src.shape[i]
            extent = src.shape[t.dim] // t.parts
            seen = 1
            for j in (j for j in gj if out.shape[j] != 1):
                size = out.shape[j]
                if seen < outer and outer % seen == 0 and (outer // seen) % size == 0:
                    seen *= size  # a dim of the outer factor only
                    continue
                rest = outer // seen if outer % seen == 0 else 0
                if not rest or size % rest:
                    break
                held = size // rest  # this dim holds the rest of the outer factor, then this much of T
                if held % extent == 0 or extent % held == 0:
                    split = min(held, extent)
                    if split % self.tp:
                        raise Broken([t], f"a reshape leaves {split} heads (or groups) on the split dimension, "
                                           f"not divisible by tp {self.tp}")
                    return Tag(j, rest, t.group, t.origin)
                break
            raise Broken([t], "a reshape cuts the split dimension off whole heads")
        raise Broken([t], "a reshape the planner cannot follow")

    def permute(self, name: str, bound: dict, out: Ref) -> Tag | None:
        src = bound["self"]
        t = self.tag(src)
        if t is None:
            return None
        n = len(src.shape)
        if name == "t":
            order = [1, 0] if n == 2 else [0]
        elif name == "permute":
            order = [_dim(d, n) for d in bound["dims"]]
        else:
            a, b = (_dim(bound.get("dim0", bound.get("source", 0)), n), _dim(bound.get("dim1", bound.get("destination", 0)), n))
            order = list(range(n))
            if name == "movedim":
                order.remove(a)
                order.insert(b, a)
            else:
                order[a], order[b] = order[b], order[a]
        return Tag(order.index(t.dim), t.parts, t.group, t.origin)

    def cut(self, name: str, bound: dict, outs: list[Ref | None]) -> list[Tag | None]:
        src = bound["self"]
        t = self.tag(src)
        if t is None:
            return [None] * len(outs)
        n = len(src.shape)
        d = _dim(bound.get("dim", 0) or 0, n)
        if name == "select":
            if d == t.dim:
                raise Broken([t], "one index is selected along the split dimension (a single shared key/value head?)")
            return [Tag(t.dim - (d < t.dim), t.parts, t.group, t.origin)]
        if d != t.dim:
            return [Tag(t.dim - (name == "unbind" and d < t.dim), t.parts, t.group, t.origin) if o is not None else None
                    for o in outs]
        size = src.shape[d]
        if name in ("slice", "narrow"):
            start = bound.get("start") or 0
            end = bound.get("end") if bound.get("end") is not None else size
            if name == "narrow":
                end = start + bound.get("length", size)
            start, end = _dim(start, size), min(_dim(end, size) if end < 0 else end, size)
            width = end - start
            if bound.get("step", 1) != 1 or width <= 0:
                raise Broken([t], f"a slice [{start}:{end}:{bound.get('step', 1)}] of the split dimension ({size})")
            if size % width or start % width or isinstance(t.parts, tuple):
                return self.unequal_parts(t, size, [(start, end)])
            widths = [width]
        else:
            widths = [o.shape[d] for o in outs if o is not None]
            if widths and sum(widths) == size and (len(set(widths)) != 1 or isinstance(t.parts, tuple)):
                bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
                return self.unequal_parts(t, size, list(zip(bounds, bounds[1:])))
        parts = size // widths[0] if widths and widths[0] else 0
        if not widths or len(set(widths)) != 1 or parts * widths[0] != size:
            raise Broken([t], f"the split dimension is cut into parts {widths} that do not cover it")
        if parts == 1:
            return [t if o is not None else None for o in outs]
        if t.parts == parts:
            return [Tag(t.dim, 1, t.group, t.origin) if o is not None else None for o in outs]
        # Not packed (or packed otherwise): pack the origin's output at these bounds, then retry.
        bounds = [start, end] if name in ("slice", "narrow") else [i * widths[0] for i in range(len(widths) + 1)]
        return self.unequal_parts(t, size, list(zip(bounds, bounds[1:])))

    def unequal_parts(self, t: Tag, size: int, cuts: list[tuple[int, int]]) -> list[Tag]:
        """The tags of the cuts ``[start:end)`` of a split dim packing parts, equal or not (Phi-3's
        grouped-query ``[q | k | v]``: ``qkv[..., :q_end]``...).

        A cut that is one part of the origin's packing is split like any output (each rank holds its
        slice of every part: ``_StridedShard`` for equal parts, rank order for unequal ones,
        :mod:`~lightning_parallel.parallel.tensor.rank_order`); otherwise the origin's output is asked
        to be packed at these bounds too (with any other cut of this pass), and the walk retries.
        """
        sizes = t.parts if isinstance(t.parts, tuple) else (size // t.parts,) * t.parts
        edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        if all(a in edges and b in edges and edges.index(b) == edges.index(a) + 1 for a, b in cuts):
            return [t if len(sizes) == 1 else Tag(t.dim, 1, t.group, t.origin) for _ in cuts]
        # The cut may be along a reshaped dim (heads): the packing is asked in the origin's output features.
        features = self.features.get(t.origin, size)
        if features % size:
            raise Broken([t], f"cuts {cuts} of a reshaped split dimension ({size} of {features} features)")
        scale = features // size
        asked = self.pack_requests.get(t.origin)
        if asked is not None:
            asked_sizes = asked if isinstance(asked, tuple) else (features // asked,) * asked
            edges += [sum(asked_sizes[:i]) // scale for i in range(len(asked_sizes) + 1)]
        bounds = sorted(set(edges) | {x for cut in cuts for x in cut})
        new = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        if new == sizes:
            raise Broken([t], f"cuts {cuts} span several parts {sizes} of a fused output")
        self.pack_requests[t.origin] = tuple(n * scale for n in new) if len(set(new)) > 1 else len(new)
        raise Broken([], "packing requested")

    def cat(self, name: str, bound: dict, out: Ref) -> Tag | None:
        refs = [r for r in bound["tensors"] if isinstance(r, Ref) and not (len(r.shape) == 1 and r.shape[0] == 0)]
        tags = [self.tag(r) for r in refs]
        live = [t for t in tags if t is not None]
        n = len(out.shape) - (name == "stack")
        d = _dim(bound.get("dim", 0), n if name != "stack" else n + 1)
        dims = {t.dim for t in live}
        if len(dims) != 1 or len({t.parts for t in live}) != 1:
            raise Broken(live, "tensors split along different dimensions are concatenated")
        td = dims.pop()
        if name == "cat" or name == "concat":
            if td == d:
                raise Broken(live, "split tensors are concatenated along the split dimension")
            return Tag(td, live[0].parts, self.union(live), live[0].origin)
        return Tag(td + (d <= td), live[0].parts, self.union(live), live[0].origin)

    def matmul(self, bound: dict, out: Ref) -> Tag | None:
        a, b = bound.get("self"), bound.get("mat2", bound.get("other"))
        ta, tb = self.tag(a), self.tag(b)
        na, nb, no = len(a.shape), len(b.shape), len(out.shape)
        placed: list[tuple[int, Tag]] = []
        if ta is not None:
            if ta.dim == na - 1:
                raise Broken([ta], "a matmul sums over the split dimension")
            placed.append((ta.dim + no - na, ta))
        if tb is not None:
            if tb.dim == nb - 2:
                raise Broken([tb], "a matmul sums over the split dimension")
            placed.append((tb.dim + no - nb, tb))
        if not placed:
            return None
        if len({(d, t.parts) for d, t in placed}) != 1:
            raise Broken([t for _, t in placed], "a matmul's operands are split along different dimensions")
        tags = [t for _, t in placed]
        return Tag(placed[0][0], tags[0].parts, self.union(tags), tags[0].origin)

    def sdpa(self, bound: dict, outs: list[Ref | None]) -> list[Tag | None]:
        q, k, v = bound["query"], bound["key"], bound["value"]
        tq, tk, tv = self.tag(q), self.tag(k), self.tag(v)
        tags = [t for t in (tq, tk, tv) if t is not None]
        mask = bound.get("attn_mask")
        tm = self.tag(mask)
        heads = len(q.shape) - 3
        if len(tags) != 3 or any(t.dim != heads or t.parts != 1 for t in tags):
            raise Broken(tags + [tm] * (tm is not None), "attention whose query, key and value are not all split by heads")
        if tm is not None:
            if tm.dim != len(mask.shape) - 3:
                raise Broken(tags + [tm], "an attention mask split along another dimension than the heads")
            tags.append(tm)
        elif isinstance(mask, Ref) and len(mask.shape) >= 3 and mask.shape[-3] != 1:
            pass  # a per-head mask, whole: sliced locally
        root = self.union(tags)
        return [Tag(heads, 1, root, tq.origin) if o is not None and len(o.shape) > heads and o.shape[heads] == q.shape[heads]
                else None for o in outs]

    def reduce(self, name: str, bound: dict, outs: list[Ref | None]) -> list[Tag | None]:
        src = bound.get("self") if "self" in bound else bound.get("input")
        t = self.tag(src)
        n = len(src.shape)
        dims = bound.get("dim")
        if dims is None:
            raise Broken([t], f"`aten.{name}` reduces over every dimension")
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not dims:
            raise Broken([t], f"`aten.{name}` reduces over every dimension")
        dims = [_dim(d, n) for d in dims]
        if t.dim in dims:
            raise Broken([t], f"`aten.{name}` reduces over the split dimension")
        keep = bool(bound.get("keepdim", False))
        new = t.dim if keep else t.dim - sum(d < t.dim for d in dims)
        return [Tag(new, t.parts, t.group, t.origin) if o is not None and len(o.shape) > new else None for o in outs]

    def index(self, bound: dict, out: Ref, tagged: list[Tag]) -> Tag | None:
        """``x[..., [i, j]]``: advanced indexing along other dims than the split one."""
        src = bound["self"]
        t = self.tag(src)
        indices = list(bound["indices"])
        if t is None or any(self.tag(i) is not None for i in indices):
            raise Broken(tagged, "`aten.index` indexes with a split tensor")
        where = [i for i, x in enumerate(indices) if x is not None]
        if t.dim in where:
            raise Broken([t], "`aten.index` indexes along the split dimension")
        width = max((len(indices[i].shape) for i in where if isinstance(indices[i], Ref)), default=0)
        contiguous = where == list(range(where[0], where[-1] + 1)) if where else True
        if contiguous and (not where or t.dim < where[0]):
            return Tag(t.dim, t.parts, t.group, t.origin)
        return Tag(t.dim - len([i for i in where if i < t.dim]) + width, t.parts, t.group, t.origin)

    def keep_unless(self, name: str, bound: dict, out: Ref, tagged: list[Tag]) -> Tag | None:
        src = bound.get("self") if "self" in bound else bound.get("input")
        t = self.tag(src)
        if t is None or len(tagged) > 1:
            raise Broken(tagged, f"`aten.{name}` reads a split tensor as an index or pad")
        n = len(src.shape)
        if name in ("triu", "tril"):
            touched = {n - 1, n - 2}
        elif name in ("constant_pad_nd", "pad"):
            pad = list(bound.get("pad", ()))
            touched = {n - 1 - i // 2 for i, p in enumerate(pad) if p}
        else:
            touched = {_dim(bound["dim"], n)}
        if t.dim in touched:
            raise Broken([t], f"`aten.{name}` works along the split dimension")
        return t if out is not None and out.shape[t.dim] == src.shape[t.dim] else None

    def pointwise(self, name: str, bound: dict, outs: list[Ref | None], tagged: list[Tag]) -> list[Tag | None]:
        shape = next((o.shape for o in outs if o is not None), None)
        if shape is None:
            return [None] * len(outs)
        placed: list[tuple[int, Tag]] = []
        for ref in refs(bound):
            t = self.tag(ref)
            if t is None:
                continue
            d = t.dim + len(shape) - len(ref.shape)
            if d < 0 or shape[d] != ref.shape[t.dim]:
                raise Broken(tagged, f"`aten.{name}` broadcasts a split dimension")
            placed.append((d, t))
        if len({(d, t.parts) for d, t in placed}) != 1:
            raise Broken(tagged, f"`aten.{name}` combines tensors split along different dimensions")
        target = bound.get("self")
        if name in ("copy", "fill", "zero") or (isinstance(target, Ref) and any(o is not None and o.id == target.id for o in outs)):
            if isinstance(target, Ref) and self.tag(target) is None:
                raise Broken(tagged, f"`aten.{name}_` writes split values into a whole tensor")
        d, first = placed[0]
        tag = Tag(d, first.parts, self.union([t for _, t in placed]), first.origin)
        return [tag if o is not None and o.shape == shape else None for o in outs]


