"""Keep ``import lightning`` working beside a torchvision whose C extension cannot load.

Why this exists: PyPI's torchvision wheels for Linux x86_64 are CUDA builds. Installed beside
a CPU build of torch of the same release (what ``pip install torch==2.13.0`` gives on these
machines), torchvision's ``_C`` extension fails to load (it links ``libtorch_cuda.so``), and
``torchvision._meta_registrations`` then calls ``torch.library.register_fake("torchvision::nms")``
for an operator that was never defined: ``RuntimeError: operator torchvision::nms does not
exist`` on ``import torchvision``. Lightning, torchmetrics and transformers import torchvision
when it is installed, so every ``import lightning`` would fail.

The fix here is the smallest one: when, and only when, the extension cannot be loaded, the
meta-kernel registrations module is replaced by an empty one before torchvision is imported.
Those kernels describe torchvision's detection operators (``nms``, ``roi_align``, ...) that do
not exist in such an install anyway; the pure-Python parts (``torchvision.models``: ResNet,
ViT, ...) are untouched and run as usual. With a working torchvision this does nothing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_MODULE = "torchvision._meta_registrations"


def _extension_loads(package_dir: Path) -> bool:
    import torch

    candidates = sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd"))
    if not candidates:
        return False
    try:
        torch.ops.load_library(str(candidates[0]))
    except (OSError, RuntimeError):
        return False
    return True


def ensure_torchvision_importable() -> None:
    """Stub torchvision's meta registrations if its C extension cannot load (see module doc)."""
    if "torchvision" in sys.modules or _MODULE in sys.modules:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    if not _extension_loads(Path(spec.origin).parent):
        stub = types.ModuleType(_MODULE)
        stub.__doc__ = "Empty stand-in: torchvision's C extension did not load (lightning_parallel._torchvision_compat)."
        sys.modules[_MODULE] = stub
