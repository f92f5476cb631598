"""Multi-layer perceptrons: the seed articles' running examples, as plain LightningModules.

* :class:`MLPClassifier` - any stack of ``nn.Linear`` + activation in one ``nn.Sequential``
  called ``net`` (the shape most hand-written MLPs have; tensor parallelism pairs its Linears
  column-wise/row-wise, a pipeline cuts ``net`` between layers).
* :class:`SeedMLP` - 1000-500-100-10, the seeds' first model-parallel example.
* :class:`LargeMLP` - 10000-5000-2000-1000-500-10, the seeds' FSDP "large model".
* :class:`DeepMLP` - a stem, ``depth`` identical blocks in ``blocks`` (an ``nn.ModuleList``) and a
  head: the seeds' 100-layer model for activation checkpointing. Repeated blocks are what FSDP
  wraps one by one, what checkpointing wraps, and where a pipeline splits.

The presets are subclasses (not functions) so that Hydra ``_target_``, LightningCLI
``--model=SeedMLP`` and ``SeedMLP.load_from_checkpoint`` all work; each saves only its own
constructor arguments (``dims`` is dropped) so ``type(m)(**m.hparams)`` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_parallel.models.base import ClassificationModule, check_positive_int
from lightning_parallel.errors import config_error

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
}
"""Activation names accepted by the MLPs; plain strings keep the constructors config-friendly."""

SEED_DIMS: tuple[int, ...] = (1000, 500, 100, 10)
LARGE_DIMS: tuple[int, ...] = (10000, 5000, 2000, 1000, 500, 10)


def check_activation(activation: str) -> str:
    """Return the lower-cased activation name or raise a config error listing the choices."""
    if not isinstance(activation, str) or activation.lower() not in ACTIVATIONS:
        raise config_error(
            ValueError,
            "activation",
            activation,
            f"must be one of {sorted(ACTIVATIONS)}",
            "use activation='relu'",
        )
    return activation.lower()


def make_activation(activation: str) -> nn.Module:
    """Build the activation named ``activation`` (validated by :func:`check_activation`)."""
    return ACTIVATIONS[check_activation(activation)]()


def _check_dims(dims: Sequence[int]) -> list[int]:
    """Validate a layer-width list; at least an input and an output width, all positive ints."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise config_error(TypeError, "dims", dims, "must be a list of ints", "pass e.g. dims=[64, 128, 10]")
    if len(dims) < 2:
        raise config_error(
            ValueError, "dims", dims, "needs at least 2 widths (input and classes)", "pass e.g. dims=[64, 128, 10]"
        )
    for i, width in enumerate(dims):
        check_positive_int(f"dims[{i}]", width)
    return [int(w) for w in dims]


class MLPClassifier(ClassificationModule):
    """``dims[0]`` features to ``dims[-1]`` class logits through Linear+activation layers.

    ``net`` is ``Linear, act, Linear, act, ..., Linear``: no activation after the last layer,
    because the logits go to cross-entropy.
    """

    def __init__(
        self,
        dims: Sequence[int] = SEED_DIMS,
        activation: str = "relu",
        lr: float = 0.05,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        # Normalised before save_hyperparameters (which reads this frame's locals) so that the
        # saved value is a plain list whatever Hydra or the CLI passed in (ListConfig, tuple).
        dims = _check_dims(dims)
        check_activation(activation)  # also when dims=[in, out] builds no activation at all
        super().__init__(dims[-1], lr, optimizer, momentum, weight_decay, eps)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(d_in, d_out))
            if i < len(dims) - 2:
                layers.append(make_activation(activation))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SeedMLP(MLPClassifier):
    """1000 -> 500 -> 100 -> 10 with ReLU: the seed articles' first (model-parallel) example."""

    def __init__(
        self,
        activation: str = "relu",
        lr: float = 0.05,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(list(SEED_DIMS), activation, lr, optimizer, momentum, weight_decay, eps)
        # Lightning merges into the base class's hparams; drop `dims`, which this preset fixes.
        self.save_hyperparameters(ignore=["dims"])


class LargeMLP(MLPClassifier):
    """10000 -> 5000 -> 2000 -> 1000 -> 500 -> 10 (~63M parameters): the seeds' FSDP example."""

    def __init__(
        self,
        activation: str = "relu",
        lr: float = 0.05,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(list(LARGE_DIMS), activation, lr, optimizer, momentum, weight_decay, eps)
        # Lightning merges into the base class's hparams; drop `dims`, which this preset fixes.
        self.save_hyperparameters(ignore=["dims"])


class DeepBlock(nn.Module):
    """One repeated unit of :class:`DeepMLP`: ``x + scale * act(fc(x))``, or ``act(fc(x))``.

    Why the scale: with PyTorch's default Linear init each residual branch adds about a sixth
    of its input's variance, so 100 unscaled blocks blow activations up by ~(7/6)^100. Scaling
    the branch by ``1/sqrt(depth)`` keeps the total growth near ``e^(1/6)`` at any depth, with
    no extra parameters. ``residual=False`` gives the seeds' plain ``Linear, ReLU`` stack (which
    trains poorly when deep; it is there for memory and layout experiments).
    """

    def __init__(self, width: int, activation: str = "relu", residual: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = make_activation(activation)
        self.residual = residual
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.fc(x))
        return x + self.scale * y if self.residual else y


class DeepMLP(ClassificationModule):
    """``stem`` (in_dim -> width), ``depth`` identical :class:`DeepBlock` s in ``blocks``, ``head``.

    The seeds' 100-layer model, built so that its repeated blocks are discoverable by type and
    position (``blocks.0`` ... ``blocks.{depth-1}``) rather than hidden in one Sequential.
    """

    def __init__(
        self,
        depth: int = 100,
        width: int = 256,
        in_dim: int = 1000,
        num_classes: int = 10,
        activation: str = "relu",
        residual: bool = True,
        lr: float = 0.05,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        for field, value in (("depth", depth), ("width", width), ("in_dim", in_dim)):
            check_positive_int(field, value)
        if not isinstance(residual, bool):
            raise config_error(TypeError, "residual", residual, "must be a bool", "pass residual=true or false")
        super().__init__(num_classes, lr, optimizer, momentum, weight_decay, eps)
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Linear(in_dim, width), make_activation(activation))
        scale = depth**-0.5
        self.blocks = nn.ModuleList(DeepBlock(width, activation, residual, scale) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
