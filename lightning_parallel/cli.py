"""``lightning-parallel``: the Lightning CLI (fit / validate / test / predict) with our strategies.

Both spellings work::

    lightning-parallel fit --model=lightning_parallel.models.SeedMLP --data=... --trainer.strategy=zero3
    lightning-parallel fit ... --trainer.strategy=lightning_parallel.HybridParallelStrategy \
        --trainer.strategy.data_parallel_size=2 --trainer.strategy.zero_stage=3

A preset name typed on the command line is expanded to the class and the preset's options
(``--trainer.strategy=zero3`` becomes the class path plus ``--trainer.strategy.zero_stage=3``),
so ``--print_config`` shows every option of the strategy and later
``--trainer.strategy.<option>=`` arguments refine the preset. (A preset name written in a YAML
config stays a string: Lightning resolves it through its strategy registry.)

Exit status: 0 when the subcommand (fit, validate, test, predict) succeeded on every rank.
Configuration errors - a bad option value, degrees that do not divide ``trainer.devices`` - are
reported in one line naming the field, the value, the rule and a fix, with exit status 2, in
the launching process before any rank is started. A run that fails on any rank exits 1: the
launching process waits for the ranks it started, so the failure of any of them is its own,
and when another rank failed first it says so in one line instead of printing the long
"connection closed" traceback that follows from it. The parallelism monitor is always on.

Lightning's launcher re-runs this command for every extra rank (like torchrun), so run it from
a shell or a subprocess, not inside a notebook or a test runner's process.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_parallel
from lightning_parallel.app.exit_status import RankExitStatus, failures_after_success, leave_launched_rank, take_launched_ranks
from lightning_parallel.callbacks import ParallelismMonitor
from lightning_parallel.errors import config_error
from lightning_parallel.strategies import PRESETS, HybridParallelStrategy

STRATEGY_FLAG = "--trainer.strategy"
CLASS_PATH = f"{HybridParallelStrategy.__module__.split('.')[0]}.{HybridParallelStrategy.__name__}"
BUILTIN_STRATEGY_VALUES = ("auto",)


def _format(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def expand_presets(args: Sequence[str]) -> list[str]:
    """Rewrite ``--trainer.strategy=<preset>`` (or ``--trainer.strategy <preset>``) into the class
    path and the preset's options, so the parser knows every option the strategy takes."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name: str | None = None
        if arg.startswith(STRATEGY_FLAG + "="):
            name = arg.split("=", 1)[1]
        elif arg == STRATEGY_FLAG and i + 1 < len(args):
            name = args[i + 1]
            i += 1
        if name is None:
            out.append(arg)
        elif name in PRESETS:
            out.append(f"{STRATEGY_FLAG}={CLASS_PATH}")
            out += [f"{STRATEGY_FLAG}.{key}={_format(value)}" for key, value in PRESETS[name][1].items()]
        else:
            out.append(f"{STRATEGY_FLAG}={name}")
        i += 1
    return out


def check_strategy_name(name: str) -> None:
    """An unknown strategy name fails here with our presets and Lightning's names and a close match."""
    known = sorted(set(StrategyRegistry.available_strategies()) | set(BUILTIN_STRATEGY_VALUES))
    if name in known or "." in name:  # a dotted name is a class path, which the parser resolved
        return
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    raise config_error(
        ValueError,
        "trainer.strategy",
        name,
        f"it must be a registered strategy name (ours: {sorted(PRESETS)}; or one of Lightning's, e.g. 'ddp') or a class path",
        f"did you mean {close[0]!r}?" if close else "pass e.g. --trainer.strategy=zero3",
    )


class LightningParallelCLI(LightningCLI):
    """LightningCLI with early checks: strategy name, options and degrees are validated in the
    launching process, so a mistake costs one line of output, not N crashed ranks."""

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.strategy, HybridParallelStrategy):
            # Degrees against devices x nodes, before the launcher starts any rank.
            trainer.strategy.resolve_dims(trainer.num_devices * trainer.num_nodes)
        return trainer

    @override
    def instantiate_classes(self) -> None:
        try:
            config = self.config[self.subcommand] if self.subcommand else self.config
            strategy = config.trainer.get("strategy")
            if isinstance(strategy, str):
                check_strategy_name(strategy)
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            print(f"lightning-parallel: error: {err}", file=sys.stderr)
            raise SystemExit(2) from err

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand; in the process that launched the other ranks, make its outcome
        theirs too (see :mod:`lightning_parallel.app.exit_status` for why)."""
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            watch = next((c for c in self.trainer.callbacks if isinstance(c, RankExitStatus)), None)
            failed = watch.failed_first if watch is not None else {}
            if not failed:
                raise  # this rank's own error: its traceback is the last thing printed
            ranks = ", ".join(f"rank {rank} exited with status {status}" for rank, status in failed.items())
            first_line = (str(err).strip().splitlines() or [""])[0]
            print(f"lightning-parallel: error: {ranks} (its error is above); rank "
                  f"{self.trainer.global_rank} failed with {type(err).__name__}: {first_line}", file=sys.stderr)
            raise SystemExit(1) from err
        # The launching rank waits for the ranks it started to exit before its own process groups go,
        # so no peer loses its connections (or the store rank 0 hosts) while it is still closing
        # them; then each rank destroys its groups itself, not in the interpreter's shutdown, where
        # gloo's threads can be torn down joinable ("terminate called without an active exception",
        # status -6; pytorch#190489). Seen now and then in tests/test_exit_status.py's `test` run.
        problems = failures_after_success(take_launched_ranks(self.trainer), self.trainer.global_rank)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if problems:
            print(f"lightning-parallel: error: {'; '.join(problems)}", file=sys.stderr)
            raise SystemExit(1)


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point ``lightning-parallel`` (also ``python -m lightning_parallel.cli``).

    Returns the exit status, 0: the console script passes it to ``sys.exit``. Failures leave by
    exception or ``SystemExit`` (2: configuration error, 1: a rank failed)."""
    assert lightning_parallel.PRESETS  # importing the package registered the strategy names
    if args is None:
        # Rewrite sys.argv itself: Lightning's launcher re-runs it for the other ranks.
        sys.argv = [sys.argv[0], *expand_presets(sys.argv[1:])]
    LightningParallelCLI(
        trainer_defaults={"callbacks": [ParallelismMonitor(), RankExitStatus()]},
        save_config_kwargs={"overwrite": True},
        args=None if args is None else expand_presets(list(args)),
    )
    if args is None:
        leave_launched_rank()  # a launched rank: no interpreter shutdown (it could abort there)
    return 0


if __name__ == "__main__":
    sys.exit(main())
