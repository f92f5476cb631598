"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks),
and torchvision importable beside the CPU build of torch (see ``lightning_parallel._torchvision_compat``)."""

import torch

from lightning_parallel._torchvision_compat import ensure_torchvision_importable

ensure_torchvision_importable()
torch.set_num_threads(1)
