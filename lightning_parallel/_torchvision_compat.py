"""Keep ``import lightning`` working beside a torchvision whose C extension cannot load.

Why this exists: PyPI's torchvision wheels for Linux x86_64 are CUDA builds. Installed beside
a CPU build of torch of the same release (what ``pip install torch==2.13.0`` gives on these
machines, and what the test extra then adds torchvision 0.28 to), torchvision's ``_C``
extension fails to load (it links ``libtorch_cuda.so``), and ``torchvision._meta_registrations``
then calls ``torch.library.register_fake("torchvision::nms")`` for an operator that was never
defined: ``RuntimeError: operator torchvision::nms does not exist`` on ``import torchvision``.
Lightning, torchmetrics and transformers import torchvision when it is installed, so every
``import lightning`` fails.

The fix is the smallest one: an import hook that, when torchvision imports its meta-kernel
registrations *and* torchvision itself reports that its extension did not load
(``torchvision.extension._has_ops()``), gives it an empty module instead. Those kernels describe
torchvision's detection operators (``nms``, ``roi_align``, ...), which do not exist in such an
install anyway; the pure-Python parts (``torchvision.models``: ResNet, ViT, ...) are untouched.
With a working torchvision the hook does nothing.

The hook is installed by ``import lightning_parallel`` (before it imports Lightning) and, for
every Python process the test suite starts (example scripts that import Lightning first, the
console scripts, torchrun workers), by ``tests/startup/sitecustomize.py`` through ``PYTHONPATH``.
This module imports nothing heavy, so that start-up hook costs nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

_MODULE = "torchvision._meta_registrations"


class _EmptyModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__doc__ = "Empty stand-in: torchvision's C extension did not load (lightning_parallel._torchvision_compat)."
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _MetaRegistrationsFinder(importlib.abc.MetaPathFinder):
    """Answers only for ``torchvision._meta_registrations``, and only when the extension is missing."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        extension = sys.modules.get("torchvision.extension")  # imported first by torchvision/__init__.py
        has_ops = getattr(extension, "_has_ops", None)
        if has_ops is None or has_ops():
            return None  # a working torchvision: import its real registrations
        return importlib.util.spec_from_loader(fullname, _EmptyModuleLoader())


def install_import_hook() -> None:
    """Install the finder once (cheap: it only looks at one module name)."""
    if not any(isinstance(finder, _MetaRegistrationsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MetaRegistrationsFinder())


def ensure_torchvision_importable() -> None:
    """Alias of :func:`install_import_hook` (the name callers used first)."""
    install_import_hook()
