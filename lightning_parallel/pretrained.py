"""Pretrained weights into any layout: every rank reads only the slices it holds.

Two ways in, both for an unchanged model:

* from the module's ``configure_model`` (Lightning's hook for sharded models)::

      def configure_model(self):
          lightning_parallel.load_pretrained(self.model, "path/to/save_pretrained_dir")

* or, without touching the module, a callback::

      Trainer(strategy="zero3", callbacks=[lightning_parallel.PretrainedWeights("path/to/dir", submodule="model")])

The source is a Hugging Face ``save_pretrained`` directory (``model.safetensors``, or shards with
``model.safetensors.index.json``; ``pytorch_model.bin`` likewise), a ``.safetensors`` file or a
torch state-dict file. Keys are the target module's own parameter names (what
``save_pretrained`` writes for a ``transformers`` model; tied weights stored once).

When. A target that still has meta tensors (built under ``Trainer.init_module(empty_init=True)``
or ``torch.device("meta")``) is loaded after the strategy has laid it out and materialised it
(:mod:`lightning_parallel.parallel.materialize`): each rank then reads the part of every tensor
it holds, a shard under ZeRO-3/FSDP2, a column or row block under tensor parallelism, its experts
under expert parallelism. A target with real tensors is loaded at once (each rank reads what it
holds now: everything, before a layout). A load still pending at the first forward is an error,
never a silent random model (a strategy that does not materialise meta models).

How, and why safetensors slicing rather than DCP's Hugging Face storage reader: each rank opens
the files with ``safe_open`` and reads ``get_slice(name)[rows, cols]`` for the global offsets of
its local shard (``compute_local_shape_and_global_offset``), so only those bytes are read (the
file is memory-mapped); torch files are opened with ``torch.load(mmap=True)`` and sliced the same
way. No collective runs, so a missing key, an unexpected key or a shape mismatch is raised on
every rank alike before any rank waits; DCP's reader plans the reads collectively and needs its
state-dict keys, tied weights and dtypes prepared to match. The cast to the parameter's dtype
(a bf16 checkpoint into fp32 master weights) happens on the slice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_parallel.compat import compute_local_shape_and_global_offset, tree_leaves
from lightning_parallel.errors import config_error

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


class _Reader:
    """Open shard files lazily; hand out sliceable views of one key at a time."""

    def __init__(self, source: dict[str, Path] | Path, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, Any] = {}
        if isinstance(source, Path):
            self.files = {key: source for key in self._keys(source)}
        else:
            self.files = dict(source)

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            else:  # memory-mapped: slicing reads only the touched pages
                self._open[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        return self._open[file]

    def _keys(self, file: Path) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            return handle[key][index].clone()
        return handle.get_slice(key)[index] if index else handle.get_tensor(key)


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


def _local_index(tensor: Tensor) -> tuple[tuple[slice, ...], Tensor]:
    """The global index range this rank holds of ``tensor`` and the local tensor to write."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(slice(o, o + s) for o, s in zip(offset, shape)), tensor.to_local()
    return tuple(slice(0, s) for s in tensor.shape), tensor


def load_pretrained_now(module: nn.Module, path: str | os.PathLike[str], strict: bool = True,
                        released: dict[str, Any] | None = None) -> dict[str, int]:
    """Read into ``module``, as laid out now, the part of each tensor this rank holds.

    Returns ``{"tensors": ..., "bytes_read": ...}`` for this rank. Pipeline ranks skip the tensors
    they released (``released``: name -> full shape; other stages own them), whose shapes are
    checked against the full ones. Raises before reading if keys or shapes do not match.
    """
    full = {_clean(name): tuple(shape) for name, shape in (released or {}).items()}
    source = _source_files(Path(path))
    with ExitStack() as stack:
        reader = _Reader(source, stack)
        targets = _targets(module)
        keys = {name: next((a for a in sorted(aliases) if a in reader.files), None) for name, (_, aliases) in targets.items()}
        known = set().union(*(aliases for _, aliases in targets.values()))
        missing = sorted(name for name, key in keys.items() if key is None)
        unexpected = sorted(set(reader.files) - known)
        if missing or (strict and unexpected):
            raise config_error(
                KeyError if missing else ValueError, "pretrained checkpoint", str(path),
                f"its keys do not match {type(module).__name__}'s: missing {missing[:5]} ({len(missing)}), "
                f"unexpected {unexpected[:5]} ({len(unexpected)})",
                "pass the submodule the checkpoint was saved from (e.g. self.model, not the LightningModule), "
                "or strict=False to ignore unexpected keys",
            )
        shapes = {k: full.get(k, tuple(t.shape)) for k, (t, _) in targets.items()}
        wrong = [(k, shapes[k], reader.shape(keys[k])) for k in targets if shapes[k] != reader.shape(keys[k])]
        if wrong:
            raise config_error(ValueError, "pretrained checkpoint", str(path),
                               f"tensor shapes differ (name, model, checkpoint): {wrong[:5]}",
                               "build the model from the checkpoint's config")
        read = 0
        with torch.no_grad():
            for name, (tensor, _) in targets.items():
                if name in full:  # released by a pipeline rank: another stage holds it
                    continue
                index, local = _local_index(tensor)
                if local.numel() == 0:  # released by a pipeline rank, or an empty uneven shard
                    continue
                part = reader.read(keys[name], index)
                local.copy_(part.to(device=local.device, dtype=local.dtype))
                read += part.numel() * part.element_size()
    stats = {"tensors": len(targets), "bytes_read": read}
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
        paths = [str(p) for p, _ in getattr(module, _PENDING_ATTR)]
        raise RuntimeError(
            f"{type(module).__name__} still waits for its pretrained weights from {paths}: it was built on the meta "
            "device and no lightning_parallel strategy materialised it. HINT: use a lightning_parallel strategy "
            "(dp, zero3, tp, ...), or build the model on a real device before load_pretrained"
        )


def load_pretrained(module: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a ``save_pretrained`` directory or a state-dict file into ``module`` (see module doc).

    On a meta-device ``module`` the load waits for the strategy's layout and materialisation, so
    each rank reads only its slices; otherwise it happens now. Checks the path at once.
    """
    _source_files(Path(path))  # a wrong path fails here, in configure_model, not later on one rank
    if not _has_meta(module):
        load_pretrained_now(module, path, strict)
        return
    pending = module.__dict__.setdefault(_PENDING_ATTR, [])
    if not pending:
        module.register_forward_pre_hook(_refuse_pending, with_kwargs=True)
    pending.append((Path(path), strict))


def run_pending_loads(root: nn.Module, released: dict[str, Any] | None = None) -> list[dict[str, int]]:
    """The strategy calls this after materialising ``root``: every deferred :func:`load_pretrained`.
    ``released``: the tensors (FQNs in ``root``, full shapes) a pipeline rank released."""
    done = []
    for prefix, sub in root.named_modules():
        own = {n.removeprefix(f"{prefix}."): shape for n, shape in (released or {}).items() if not prefix or n.startswith(f"{prefix}.")}
        for path, strict in sub.__dict__.pop(_PENDING_ATTR, []):
            done.append(load_pretrained_now(sub, path, strict, released=own))
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
