"""Export a checkpoint of any layout as a plain state dict (torch or safetensors), offline.

The result holds only the model's tensors under their original names, so the unwrapped
LightningModule (or any copy of the model class) loads it with ``load_state_dict(strict=True)``
without lightning_parallel installed. Sharded DCP directories are read without a process group.

Export streams tensor by tensor, so a model larger than this machine's memory exports too:

* ``.safetensors``: the header (names, dtypes, shapes, offsets) comes from the checkpoint's
  metadata; then each tensor is read (from the DCP shards, or from the memory-mapped file) and
  its bytes written, before the next is read. At most one tensor is in memory.
* ``.pt``: ``torch.save`` writes a dict whose tensors must all exist at once, so each tensor is
  read into a memory-mapped scratch file beside the output (file-backed pages the kernel can
  write back and drop) rather than into anonymous memory; a consolidated source is mapped as is.

    python -m lightning_parallel.export CHECKPOINT OUT.pt
    python -m lightning_parallel.export CHECKPOINT OUT.safetensors

Reads are weights-only, as ``torch.load``'s default: a checkpoint holding an object that could
run code when unpickled is refused (``UnsafeCheckpointError``) unless the caller trusts it
(``weights_only=False``, ``--no-weights-only``). A sharded directory's DCP metadata is read the
same way (:mod:`lightning_parallel.strategies.checkpoint.safe_load`).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.errors import config_error
from lightning_parallel.strategies.checkpoint.files import META_FILENAME, is_sharded_checkpoint
from lightning_parallel.strategies.checkpoint.safe_load import dcp_load, load_file, read_metadata

EXPORT_HOW = ("export it with weights_only=False: `export_state_dict(checkpoint, out, weights_only=False)` (or"
              " `load_model_state(checkpoint, weights_only=False)`; on the command line"
              " `python -m lightning_parallel.export --no-weights-only CHECKPOINT OUT`)")

_PREFIX = "state_dict."


def load_model_state(checkpoint: str | Path, weights_only: bool | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded directory or a consolidated file (no process group).

    Every tensor at once (a consolidated file's memory-mapped); to write a file, use
    :func:`export_state_dict`, which holds one tensor at a time. ``weights_only``: as ``torch.load``'s
    (``None``: weights-only); ``False`` only for a file you trust."""
    layout, read = _source(Path(checkpoint), weights_only)
    return {name: read(name, None) for name in layout}


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
Layout = dict[str, tuple[torch.Size, torch.dtype]]


def _source(path: Path, weights_only: bool | None) -> tuple[Layout, Callable[[str, torch.Tensor | None], torch.Tensor]]:
    """The model tensors' layout and a reader of one tensor (into ``out`` when given), no process group."""
    if is_sharded_checkpoint(path):
        metadata = read_metadata(path, weights_only, EXPORT_HOW).state_dict_metadata
        layout = {key[len(_PREFIX):]: (torch.Size(meta.size), meta.properties.dtype)
                  for key, meta in metadata.items() if key.startswith(_PREFIX) and hasattr(meta, "size")}

        def read_shard(name: str, out: torch.Tensor | None) -> torch.Tensor:
            shape, dtype = layout[name]
            box = {_PREFIX + name: out if out is not None else torch.empty(shape, dtype=dtype)}
            dcp_load(box, path, weights_only, EXPORT_HOW)  # reads this one tensor's chunks only
            return box[_PREFIX + name]

        return layout, read_shard
    if path.is_file():
        state = load_file(path, weights_only, EXPORT_HOW, mmap=True)["state_dict"]
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        return {k: (v.shape, v.dtype) for k, v in tensors.items()}, lambda name, out: tensors[name].detach()
    raise config_error(
        FileNotFoundError, "checkpoint", str(path),
        f"it must be a checkpoint file or a sharded checkpoint directory (with {META_FILENAME})",
        "pass the path ModelCheckpoint or trainer.save_checkpoint wrote",
    )


def _write_safetensors(out: Path, layout: Layout, read: Callable[[str, torch.Tensor | None], torch.Tensor]) -> None:
    """The safetensors format written by hand: 8-byte header length, JSON header, raw little-endian bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in layout.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise config_error(TypeError, f"tensor `{name}`", str(dtype), "safetensors has no such dtype", "export to .pt")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in layout:
            tensor = read(name, None).contiguous()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor


def _write_torch(out: Path, layout: Layout, read: Callable[[str, torch.Tensor | None], torch.Tensor], sharded: bool) -> None:
    if not sharded:  # memory-mapped already
        torch.save({name: read(name, None) for name in layout}, out)
        return
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".export-") as scratch:
        state = {}
        for i, (name, (shape, dtype)) in enumerate(layout.items()):
            numel = math.prod(shape)
            buffer = (torch.from_file(str(Path(scratch) / f"{i}.bin"), shared=True, size=numel, dtype=dtype).view(shape)
                      if numel else torch.empty(shape, dtype=dtype))
            state[name] = read(name, buffer)
        torch.save(state, out)


def export_state_dict(checkpoint: str | Path, out: str | Path, weights_only: bool | None = None) -> Layout:
    """Write the model state as ``.pt`` (torch.save of plain tensors) or ``.safetensors``, tensor by
    tensor (see the module docstring); return every exported tensor's shape and dtype.
    ``weights_only``: as ``torch.load``'s (``None``: weights-only); ``False`` only for a file you trust."""
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise config_error(ValueError, "out", str(out), "the file name must end in .pt, .pth, .bin or .safetensors",
                           "e.g. model.safetensors")
    path = Path(checkpoint)
    layout, read = _source(path, weights_only)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        _write_safetensors(out, layout, read)
    else:
        _write_torch(out, layout, read, is_sharded_checkpoint(path))
    return layout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint file or sharded checkpoint directory")
    parser.add_argument("out", help="output file: .pt / .pth / .bin or .safetensors")
    parser.add_argument("--no-weights-only", action="store_true",
                        help="unpickle any object the checkpoint holds (weights_only=False): only for a file you trust")
    args = parser.parse_args(argv)
    layout = export_state_dict(args.checkpoint, args.out, weights_only=False if args.no_weights_only else None)
    numel = sum(math.prod(shape) for shape, _ in layout.values())
    print(f"wrote {len(layout)} tensors ({numel:,} values) to {args.out}")


if __name__ == "__main__":
    main()
