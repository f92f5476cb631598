"""The model zoo: plain LightningModules that know nothing about parallelism.

Each model is what a user would write by hand; the strategies in
:mod:`lightning_parallel.strategies` must train it unchanged. Constructor arguments are plain
types so Hydra ``_target_`` and the Lightning CLI can build them from config.
"""

from lightning_parallel.models.base import ClassificationModule
from lightning_parallel.models.gpt import GPT, MLP, Block, CausalSelfAttention
from lightning_parallel.models.llama import Llama
from lightning_parallel.models.mlp import DeepBlock, DeepMLP, LargeMLP, MLPClassifier, SeedMLP
from lightning_parallel.models.moe_gpt import MoEGPT

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "ClassificationModule",
    "DeepBlock",
    "DeepMLP",
    "LargeMLP",
    "Llama",
    "MLPClassifier",
    "MoEGPT",
    "SeedMLP",
]
