"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks)."""

import torch

torch.set_num_threads(1)
