"""Export a checkpoint of any layout as a plain state dict (torch or safetensors), offline.

The result holds only the model's tensors under their original names, so the unwrapped
LightningModule (or any copy of the model class) loads it with ``load_state_dict(strict=True)``
without lightning_parallel installed. Sharded DCP directories are read without a process group.

    python -m lightning_parallel.export CHECKPOINT OUT.pt
    python -m lightning_parallel.export CHECKPOINT OUT.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_parallel.errors import config_error
from lightning_parallel.strategies.checkpoint import META_FILENAME, is_sharded_checkpoint

_PREFIX = "state_dict."


def load_model_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded directory or a consolidated file (no process group)."""
    path = Path(checkpoint)
    if is_sharded_checkpoint(path):
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        template = {
            key[len(_PREFIX):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith(_PREFIX) and hasattr(meta, "size")
        }
        state = {"state_dict": template}
        dcp.load(state, checkpoint_id=str(path))
        return state["state_dict"]
    if path.is_file():
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        return {k: v for k, v in loaded["state_dict"].items() if isinstance(v, torch.Tensor)}
    raise config_error(
        FileNotFoundError, "checkpoint", str(path),
        f"it must be a checkpoint file or a sharded checkpoint directory (with {META_FILENAME})",
        "pass the path ModelCheckpoint or trainer.save_checkpoint wrote",
    )


def export_state_dict(checkpoint: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Write the model state as ``.pt`` (torch.save of plain tensors) or ``.safetensors``."""
    out = Path(out)
    state = {k: v.detach().contiguous() for k, v in load_model_state(checkpoint).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("Exporting to .safetensors needs the safetensors package: pip install safetensors") from err
        save_file(state, str(out))
    elif out.suffix in (".pt", ".pth", ".bin"):
        torch.save(state, out)
    else:
        raise config_error(ValueError, "out", str(out), "the file name must end in .pt, .pth, .bin or .safetensors",
                           "e.g. model.safetensors")
    return state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint file or sharded checkpoint directory")
    parser.add_argument("out", help="output file: .pt / .pth / .bin or .safetensors")
    args = parser.parse_args(argv)
    state = export_state_dict(args.checkpoint, args.out)
    numel = sum(v.numel() for v in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} values) to {args.out}")


if __name__ == "__main__":
    main()
