"""Every private Lightning API lightning_parallel uses, in one place, each with the public API to move to.

The Lightning half of :mod:`lightning_parallel.compat` (kept apart so that the torch layer,
``parallel/``, imports nothing from Lightning). Lightning's own strategies (``DDPStrategy``,
``ModelParallelStrategy``) are built from these same private helpers: a third-party strategy
that behaves like them has no public alternative for most of them. ``tests/test_compat.py``
fails when another module of the package imports a private Lightning name directly, and checks
that every entry of :data:`PRIVATE_APIS` still resolves in the installed Lightning.

"Since" is the oldest ``lightning`` release whose sources define the name, read from the
released wheels of 2.1 to 2.6 (2.1 means "2.1 or older"); 2.6 is the one installed and tested.

Not routed through here, by judgement: the attributes a ``Strategy`` subclass sets on itself
(``self._launcher``, ``self._lightning_module``, ``self._process_group_backend``, ...), which is
how Lightning documents writing a strategy and how every built-in strategy does it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

# --- collectives with Lightning's semantics --------------------------------------------------
# Why: Strategy.reduce / all_gather must behave as DDPStrategy's (mean reduction of a tensor or
# number, "sum"/"mean" strings, a no-op without a process group). Since: 2.1; the "is
# initialised" check since 2.2. Public: torch.distributed.all_reduce / all_gather (without
# Lightning's argument handling) and torch.distributed.is_initialized.
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_ddp_if_available
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available

# --- process group lifetime --------------------------------------------------------------------
# Why: the group is created from Lightning's ClusterEnvironment (torchrun, SLURM, LSF, ...) the
# way its strategies do, with the same default backend per device, and destroyed at exit.
# Since: 2.1 (_destroy_dist_connection: 2.3). Public: torch.distributed.init_process_group /
# destroy_process_group with the environment's address and ranks read by hand.
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_dist_connection
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend_for_device,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection

# --- optimizer state placement -----------------------------------------------------------------
# Why: the optimizer state follows the model to its device after a restore, as in every
# Lightning strategy. Since: 2.1. Public: none (move each state tensor by hand).
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

# --- launchers -----------------------------------------------------------------------------------
# Why: the strategy picks the launcher Lightning would (subprocess script, or spawn/fork for
# notebooks), and the exit-status callback recognises the script launcher. Since: 2.1.
# Public: none (Strategy._configure_launcher is the documented hook, and it takes these classes).
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher

#: The oldest lightning release with every API the package uses (see pyproject.toml): 2.3 adds the
#: private names above, 2.4 ``seed_everything(verbose=)`` (testing/parity.py, app/job.py). Run here:
#: 2.4.0 passes the dp-preset and pp2-schedule parity tests with torch 2.13; 2.3.0 fails them.
LIGHTNING_LOWER_BOUND = (2, 4)


def attached_trainer(module: Any) -> Any | None:
    """``LightningModule._trainer``: the Trainer the module is attached to, or None.

    Why: code that also runs outside ``fit`` (a probe, a unit test) must not raise. Since: 2.1.
    Public: ``LightningModule.trainer``, which raises when no Trainer is attached.
    """
    return getattr(module, "_trainer", None)


def backward_skipped(trainer: Any) -> bool:
    """``trainer.fit_loop._skip_backward``: whether the running fit skips backward and ``zero_grad``
    (Lightning's ``StochasticWeightAveraging`` sets it while it recomputes BatchNorm statistics).

    Why: the strategy frees gradients early only when Lightning's ``zero_grad`` follows
    (``strategies/early_zero_grad.py``). Since: 2.1. Public: none.
    """
    fit_loop = getattr(trainer, "fit_loop", None)
    return bool(getattr(fit_loop, "_skip_backward", False))


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Set ``LightningModule._device_mesh``, which the read-only ``device_mesh`` property returns.

    Why: users of Lightning's ``ModelParallelStrategy`` read ``self.device_mesh`` in their module;
    Lightning's strategy sets the same attribute. Since: 2.3. Public: none (the property has no
    setter).
    """
    module._device_mesh = mesh


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (else ``optimizer`` itself).

    Public already (``LightningOptimizer.optimizer``, 2.1); here so that no module reads the
    private ``_optimizer`` attribute the same object also has.
    """
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def trainer_call_weights_only() -> bool | None:
    """The ``weights_only`` the running ``trainer.fit/validate/test/predict(...)`` call received (else None).

    Why: Lightning 2.6 passes it to ``Strategy.load_checkpoint`` only for strategies that restore
    before setup; for one that restores after setup (this package's, as Lightning's own
    ``ModelParallelStrategy``) ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)``
    without it, so a user's explicit ``weights_only=False`` would never arrive. It is a local of
    ``Trainer._run``, read from the call stack (the frame running ``Trainer._run``'s code); no such
    frame (a direct ``load_checkpoint`` call) gives None, torch's safe default. Since: 2.1 (``Trainer._run``;
    its ``weights_only`` local since 2.6: before, the Trainer takes no such argument and this returns
    None). Public: the ``weights_only`` argument
    of ``Strategy.load_checkpoint``, once Lightning passes it after setup too.
    """
    from lightning.pytorch import Trainer

    code = Trainer._run.__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("weights_only")
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame referenced from its own locals is a cycle


@dataclass(frozen=True)
class PrivateApi:
    """One private Lightning name the package uses: where it lives and what to move to."""

    name: str  # how this module exports it
    target: str  # "module:attr.attr" in lightning
    since: str  # oldest lightning release that defines it (checked in the 2.1-2.6 wheels)
    public: str  # the public API to move to, or "none yet"


_DIST = "lightning.fabric.utilities.distributed"
PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi("all_gather_ddp_if_available", f"{_DIST}:_all_gather_ddp_if_available", "2.1",
               "torch.distributed.all_gather"),
    PrivateApi("distributed_is_initialized", f"{_DIST}:_distributed_is_initialized", "2.2",
               "torch.distributed.is_initialized"),
    PrivateApi("sync_ddp_if_available", f"{_DIST}:_sync_ddp_if_available", "2.1", "torch.distributed.all_reduce"),
    PrivateApi("destroy_dist_connection", f"{_DIST}:_destroy_dist_connection", "2.3",
               "torch.distributed.destroy_process_group"),
    PrivateApi("default_process_group_backend_for_device", f"{_DIST}:_get_default_process_group_backend_for_device",
               "2.1", "none"),
    PrivateApi("init_dist_connection", f"{_DIST}:_init_dist_connection", "2.1", "torch.distributed.init_process_group"),
    PrivateApi("optimizers_to_device", "lightning.fabric.utilities.optimizer:_optimizers_to_device", "2.1", "none"),
    PrivateApi("MultiProcessingLauncher", "lightning.pytorch.strategies.launchers:_MultiProcessingLauncher", "2.1",
               "none"),
    PrivateApi("SubprocessScriptLauncher", "lightning.pytorch.strategies.launchers:_SubprocessScriptLauncher", "2.1",
               "none"),
    PrivateApi("attached_trainer", "lightning.pytorch:LightningModule.trainer", "2.1", "LightningModule.trainer"),
    PrivateApi("set_device_mesh", "lightning.pytorch:LightningModule.device_mesh", "2.3", "none"),
    PrivateApi("backward_skipped", "lightning.pytorch.loops.fit_loop:_FitLoop._skip_backward", "2.1", "none"),
    PrivateApi("trainer_call_weights_only", "lightning.pytorch:Trainer._run", "2.1",
               "Strategy.load_checkpoint(weights_only=...) once Lightning passes it after setup"),
)

#: Private attribute names reached only through the wrappers above (the test rejects
#: ``x.<name>`` and ``getattr(x, "<name>")`` for these anywhere else in the package).
PRIVATE_ATTRIBUTES = frozenset({"_trainer", "_device_mesh", "_optimizer", "_skip_backward"})

__all__ = [
    "LIGHTNING_LOWER_BOUND", "PRIVATE_APIS", "PRIVATE_ATTRIBUTES", "MultiProcessingLauncher", "PrivateApi",
    "SubprocessScriptLauncher", "all_gather_ddp_if_available", "attached_trainer", "backward_skipped", "default_process_group_backend_for_device",
    "destroy_dist_connection", "distributed_is_initialized", "init_dist_connection", "optimizers_to_device",
    "set_device_mesh", "sync_ddp_if_available", "trainer_call_weights_only", "unwrap_optimizer",
]
