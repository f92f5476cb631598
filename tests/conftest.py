"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks),
and torchvision importable beside the CPU build of torch (see ``lightning_parallel._torchvision_compat``),
in this process and, through ``tests/startup/sitecustomize.py`` on ``PYTHONPATH``, in every process
the tests start."""

import os
from pathlib import Path

import torch

from lightning_parallel._torchvision_compat import install_import_hook

install_import_hook()
_SITE = str(Path(__file__).resolve().parent / "startup")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH", "")) if p)
torch.set_num_threads(1)
