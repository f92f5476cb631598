"""Pretrained weights into any layout: every rank reads only the slices it holds.

Two ways in, both for an unchanged model:

* from the module's ``configure_model`` (Lightning's hook for sharded models)::

      def configure_model(self):
          lightning_parallel.load_pretrained(self.model, "path/to/save_pretrained_dir")

* or, without touching the module, a callback::

      Trainer(strategy="zero3", callbacks=[lightning_parallel.PretrainedWeights("path/to/dir", submodule="model")])

The source is a Hugging Face ``save_pretrained`` directory (``model.safetensors``, or shards with
``model.safetensors.index.json``; ``pytorch_model.bin`` likewise), a ``.safetensors`` file or a
torch state-dict file. Keys are the target module's own parameter names (tied weights stored
once), or, for a ``transformers`` model, what ``from_pretrained`` maps to them with the model's
checkpoint conversion mapping: a Mixtral or Qwen2-MoE checkpoint stores one tensor per expert and
projection, the model one fused ``experts.gate_up_proj`` / ``down_proj`` per layer
(:mod:`lightning_parallel.pretrained_convert`).

When. A target that still has meta tensors (built under ``Trainer.init_module(empty_init=True)``
or ``torch.device("meta")``) is loaded after the strategy has laid it out and materialised it
(:mod:`lightning_parallel.parallel.materialize`): each rank then reads the part of every tensor
it holds, a shard under ZeRO-3/FSDP2, a column or row block under tensor parallelism, its experts
under expert parallelism. A target with real tensors is loaded at once (each rank reads what it
holds now: everything, before a layout). A load still pending at the first forward is an error,
never a silent random model (a strategy that does not materialise meta models).

How, and why safetensors slicing rather than DCP's Hugging Face storage reader: each rank opens
the files with ``safe_open`` and reads ``get_slice(name)[rows, cols]`` for the global indices of
its local shard (as DTensor splits them: one range per dim, or the parts of a packed
``_StridedShard`` one), so only those bytes are read (the file is memory-mapped); torch files are
opened with ``torch.load(mmap=True)`` and sliced the same way. A fused expert parameter is read as
the boxes of the per-expert tensors its shard covers (its experts under expert parallelism, its
gate and up rows of every expert under tensor parallelism). No collective runs, so a missing key,
an unexpected key, a conversion that fails or a shape mismatch is raised on every rank alike
before any rank waits; DCP's reader plans the reads collectively and needs its state-dict keys,
tied weights and dtypes prepared to match. The cast to the parameter's dtype
(a bf16 checkpoint into fp32 master weights) happens on the slice.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from typing_extensions import override

from lightning_parallel.compat import StridedShard, tree_leaves
from lightning_parallel.errors import config_error
from lightning_parallel.parallel.tensor.rank_order import rank_order
from lightning_parallel.pretrained_convert import (Box, Conversions, Lazy, Source, conversions, describe, full_box, plan_reads,
                                                   runs_of)

_PENDING_ATTR = "_lp_pending_pretrained"
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def _source_files(path: Path) -> dict[str, Path] | Path:
    """``{key: shard file}`` from an index, or the single file holding every key."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise config_error(FileNotFoundError, "path", str(path), "no such file or directory",
                           "pass a save_pretrained directory, a .safetensors file or a torch state-dict file")
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {key: path / name for key, name in weight_map.items()}
    for name in ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth"):
        if (path / name).is_file():
            return path / name
    raise config_error(FileNotFoundError, "path", str(path),
                       "holds no model.safetensors(.index.json) or pytorch_model.bin(.index.json)",
                       "save the model with save_pretrained(path), or pass the weights file itself")


_PRETRAINED_HOW = ("convert it: load_pretrained reads .bin files weights-only always, so load it once yourself"
                   " (`torch.load(file, weights_only=False)` into the model) and save it as safetensors"
                   " (`model.save_pretrained(path)`), which holds no code")


class _Reader:
    """Open shard files lazily; read boxes of one key at a time, counting the bytes read."""

    def __init__(self, source: dict[str, Path] | Path, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, Any] = {}
        self.bytes_read = 0
        if isinstance(source, Path):
            self.files = {key: source for key in self._keys(source)}
        else:
            self.files = dict(source)

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            else:  # memory-mapped: slicing reads only the touched pages; weights-only, never code
                # (deferred: the strategies import this module)
                from lightning_parallel.strategies.checkpoint.safe_load import load_file

                self._open[file] = load_file(file, True, _PRETRAINED_HOW, mmap=True)
        return self._open[file]

    def _keys(self, file: Path) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """From an empty slice (safetensors names dtypes in its own spelling; this reads no data)."""
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            return handle[key].dtype
        return handle.get_slice(key)[0:0].dtype if self.shape(key) else handle.get_tensor(key).dtype

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            part = handle[key][index].clone()
        else:
            part = handle.get_slice(key)[index] if index else handle.get_tensor(key)
        self.bytes_read += part.numel() * part.element_size()
        return part


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _targets(module: nn.Module) -> dict[str, tuple[Tensor, set[str]]]:
    """Each tensor a checkpoint holds (parameters, persistent buffers) by clean name, with the
    other names a tied tensor goes by (a torch ``state_dict`` lists every alias; a
    ``save_pretrained`` file stores the tensor once, under any one of them)."""
    out: dict[str, tuple[Tensor, set[str]]] = {}
    first: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.state_dict(keep_vars=True).items()]
    for name, tensor in named:
        if not isinstance(tensor, Tensor):
            continue
        name = _clean(name)
        if id(tensor) not in first:
            first[id(tensor)] = name
            out[name] = (tensor, {name})
        else:
            out[first[id(tensor)]][1].add(name)
    return out


def _placement_on(placement: Placement, dim: int, ndim: int) -> Placement:
    """``placement`` as it acts on tensor dim ``dim`` alone, moved to dim 0 of a 1-D index tensor."""
    if isinstance(placement, StridedShard) and placement.dim % ndim == dim:
        return StridedShard(0, split_factor=placement.split_factor)
    if isinstance(placement, Shard) and placement.dim % ndim == dim:
        return Shard(0)
    return Replicate()


def _held_indices(tensor: DTensor, dim: int) -> list[int]:
    """The global indices of ``dim`` this rank holds, in its local order: the placements that split
    ``dim`` applied to ``arange`` by DTensor itself (``src_data_rank=None``: a local split, no
    collective), so packed ``_StridedShard`` parts and nested shards come out as DTensor lays them
    out (``compute_local_shape_and_global_offset`` gives only the first offset of a strided shard)."""
    on_dim = [_placement_on(p, dim, tensor.ndim) for p in tensor.placements]
    order = rank_order(tensor)  # stored in rank order (Phi-3's qkv_proj under tp): which rows it holds
    index = order.stored_index() if order is not None and order.dim == dim else torch.arange(tensor.shape[dim])
    index = index.to(tensor.device_mesh.device_type)
    return distribute_tensor(index, tensor.device_mesh, on_dim, src_data_rank=None).to_local().tolist()


def _local_box(tensor: Tensor) -> tuple[Box, Tensor]:
    """The global index runs this rank holds of ``tensor``, per dim, and the local tensor to write."""
    if not isinstance(tensor, DTensor):
        return full_box(tuple(tensor.shape)), tensor
    split = {p.dim % tensor.ndim for p in tensor.placements if isinstance(p, (Shard, StridedShard))}
    box = tuple(runs_of(_held_indices(tensor, d)) if d in split else ((0, n),) for d, n in enumerate(tensor.shape))
    return box, tensor.to_local()


def _plan(module: nn.Module, reader: _Reader, path: str | os.PathLike[str], strict: bool,
          targets: dict[str, tuple[Tensor, set[str]]], mapping: Conversions) -> dict[str, Lazy]:
    """Each target's placeholder (its checkpoint tensor, or the conversion of several); raises if
    keys are missing, unexpected (``strict``) or a conversion fails, naming the keys."""
    names = {alias: name for name, (_, aliases) in targets.items() for alias in aliases}
    plan = plan_reads(module, list(reader.files), names, lambda key: Source(reader, key), mapping)
    missing = sorted(set(targets) - set(plan.tensors) - set(plan.failed))
    if missing or (strict and plan.unexpected):
        raise config_error(
            KeyError if missing else ValueError, "pretrained checkpoint", str(path),
            f"its keys do not match {type(module).__name__}'s: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {plan.unexpected[:5]} ({len(plan.unexpected)})",
            "pass the submodule the checkpoint was saved from (e.g. self.model, not the LightningModule), "
            "or strict=False to ignore unexpected keys",
        )
    if plan.failed:
        raise config_error(ValueError, "pretrained checkpoint", str(path),
                           f"its tensors do not convert to {type(module).__name__}'s (target: why): "
                           f"{list(plan.failed.items())[:3]} ({len(plan.failed)})",
                           "build the model from the checkpoint's config")
    return plan.tensors


def _check_shapes(lazies: dict[str, Lazy], shapes: dict[str, tuple[int, ...]], path: str | os.PathLike[str]) -> None:
    """Every target's full shape against what its sources make (a wrong expert count, hidden size, ...)."""
    wrong = []
    for name, lazy in lazies.items():
        try:
            made: Any = lazy.shape
        except (ValueError, RuntimeError) as err:  # sources that do not stack or concatenate
            made = str(err)
        if made != shapes[name]:
            wrong.append((name, shapes[name], made, describe(lazy.sources())))
    if wrong:
        raise config_error(ValueError, "pretrained checkpoint", str(path),
                           f"tensor shapes differ (name, model, checkpoint, from): {wrong[:5]} ({len(wrong)})",
                           "build the model from the checkpoint's config")


def load_pretrained_now(module: nn.Module, path: str | os.PathLike[str], strict: bool = True,
                        released: dict[str, Any] | None = None, mapping: Conversions | None = None) -> dict[str, int]:
    """Read into ``module``, as laid out now, the part of each tensor this rank holds.

    Returns ``{"tensors": ..., "bytes_read": ...}`` for this rank. Pipeline ranks skip the tensors
    they released (``released``: name -> full shape; other stages own them), whose shapes are
    checked against the full ones. Raises before reading if keys or shapes do not match.
    Checkpoint keys are mapped to the module's tensors by ``transformers``' conversion mapping for
    a ``transformers`` model (per-expert checkpoint tensors into fused expert parameters), as is
    otherwise (:mod:`lightning_parallel.pretrained_convert`). ``mapping``: the one looked up before
    the layout (:func:`load_pretrained` passes it), else looked up now.
    """
    full = {_clean(name): tuple(shape) for name, shape in (released or {}).items()}
    source = _source_files(Path(path))
    with ExitStack() as stack:
        reader = _Reader(source, stack)
        targets = _targets(module)
        lazies = _plan(module, reader, path, strict, targets, conversions(module) if mapping is None else mapping)
        _check_shapes(lazies, {k: full.get(k, tuple(t.shape)) for k, (t, _) in targets.items()}, path)
        with torch.no_grad():
            for name, (tensor, _) in targets.items():
                if name in full:  # released by a pipeline rank: another stage holds it
                    continue
                box, local = _local_box(tensor)
                if local.numel() == 0:  # released by a pipeline rank, or an empty uneven shard
                    continue
                local.copy_(lazies[name].read(box).to(device=local.device, dtype=local.dtype))
    stats = {"tensors": len(targets), "bytes_read": reader.bytes_read}
    module.__dict__["_lp_pretrained_stats"] = stats  # what this rank read, for logs and tests
    return stats


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _refuse_pending(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    """A forward of a model still waiting for its weights fails; one on meta inputs only (a pipeline
    tracing its stages before it materialises them) computes nothing and goes through."""
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    if inputs and all(t.is_meta for t in inputs):
        return
    if getattr(module, _PENDING_ATTR, None):
        paths = [str(p) for p, *_ in getattr(module, _PENDING_ATTR)]
        raise RuntimeError(
            f"{type(module).__name__} still waits for its pretrained weights from {paths}: it was built on the meta "
            "device and no lightning_parallel strategy materialised it. HINT: use a lightning_parallel strategy "
            "(dp, zero3, tp, ...), or build the model on a real device before load_pretrained"
        )


def load_pretrained(module: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a ``save_pretrained`` directory or a state-dict file into ``module`` (see module doc).

    On a meta-device ``module`` the load waits for the strategy's layout and materialisation, so
    each rank reads only its slices; otherwise it happens now. Checks the path at once, and looks
    up the checkpoint conversion mapping now, on the model as built: FSDP2 gives a unit it wraps a
    class of its own (``FSDPMixtralForCausalLM``, defined in torch), which transformers takes for
    custom code without a mapping.
    """
    _source_files(Path(path))  # a wrong path fails here, in configure_model, not later on one rank
    mapping = conversions(module)
    if not _has_meta(module):
        load_pretrained_now(module, path, strict, mapping=mapping)
        return
    pending = module.__dict__.setdefault(_PENDING_ATTR, [])
    if not pending:
        module.register_forward_pre_hook(_refuse_pending, with_kwargs=True)
    pending.append((Path(path), strict, mapping))


def run_pending_loads(root: nn.Module, released: dict[str, Any] | None = None) -> list[dict[str, int]]:
    """The strategy calls this after materialising ``root``: every deferred :func:`load_pretrained`.
    ``released``: the tensors (FQNs in ``root``, full shapes) a pipeline rank released."""
    done = []
    for prefix, sub in root.named_modules():
        own = {n.removeprefix(f"{prefix}."): shape for n, shape in (released or {}).items() if not prefix or n.startswith(f"{prefix}.")}
        for path, strict, mapping in sub.__dict__.pop(_PENDING_ATTR, []):
            done.append(load_pretrained_now(sub, path, strict, released=own, mapping=mapping))
    return done


class PretrainedWeights(Callback):
    """Callback: ``load_pretrained(pl_module.<submodule>, path)`` at set-up, for a module left unchanged.

    Runs in ``setup`` (before ``configure_model`` and the strategy's layout), so a meta-built
    model is loaded slice by slice after its layout. ``submodule``: attribute path of the
    module the checkpoint was saved from (``"model"`` for ``self.model = AutoModel...``);
    ``""`` for the LightningModule itself.
    """

    def __init__(self, path: str | os.PathLike[str], submodule: str = "model", strict: bool = True) -> None:
        self.path, self.submodule, self.strict = Path(path), submodule, strict
        self._loaded: set[int] = set()

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        target = pl_module.get_submodule(self.submodule) if self.submodule else pl_module
        if id(target) in self._loaded:
            return  # fit, then test on the same Trainer: the trained weights stay
        self._loaded.add(id(target))
        load_pretrained(target, self.path, self.strict)


__all__ = ["PretrainedWeights", "load_pretrained", "load_pretrained_now", "run_pending_loads"]
