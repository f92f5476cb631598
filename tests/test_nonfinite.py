"""Non-finite gradients: every rank makes the same decision (``strategies/nonfinite.py``).

A callback poisons one element of the first local gradient on rank 0 only, after the backward
(after DDP's all-reduce and FSDP2's reduce-scatter), so without one collective decision rank 1
would step while rank 0 fails or skips, and the next collective would hang. Checked under
``dp``, ``zero3``, ``tp``, ``pp`` and ``3d`` (2 processes: one model axis):

* default ``on_nonfinite="error"``: every rank raises ``NonFiniteError`` at the poisoned step,
  with the step number and the name of the poisoned parameter, and no rank has stepped with it;
* ``"skip"``: the poisoned step changes no parameter on any rank, training goes on, and the
  parameters end equal on every rank;
* ``"skip"`` with ``max_nonfinite_skips=2`` and two poisoned steps in a row fails on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_parallel.testing import run_distributed

TOKENS = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "lr": 0.1}
STRATEGIES = ("dp", "zero3", "tp", "pp", "3d")


def _fit(strategy: str, mode: str, poison_steps: tuple[int, ...], max_skips: int = 3) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    import lightning_parallel
    from lightning_parallel.models import GPT
    from lightning_parallel.strategies.nonfinite import NonFiniteError
    from lightning_parallel.testing.parity import full_parameters, token_data

    class Poison(pl.Callback):
        poisoned: str | None = None

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank != 0 or trainer.global_step not in poison_steps:
                return
            for name, param in pl_module.named_parameters():
                grad = param.grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if local is not None and local.numel() > 0:
                    local.view(-1)[0] = float("nan")
                    Poison.poisoned = name
                    return

    class Snapshot(pl.Callback):
        def __init__(self) -> None:
            self.per_step: list[dict[str, torch.Tensor]] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.per_step.append(full_parameters(pl_module))

    pl.seed_everything(7, verbose=False)
    model = GPT(**TOKENS)
    snapshot = Snapshot()
    strat = lightning_parallel.strategy_from_name(strategy, on_nonfinite=mode, max_nonfinite_skips=max_skips)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strat, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Poison(), snapshot], gradient_clip_val=1.0)
    loader = DataLoader(token_data(num_samples=64, block_size=8, vocab_size=32), batch_size=4)
    error = None
    try:
        trainer.fit(model, loader)
    except NonFiniteError as exc:
        error = str(exc)
    steps = snapshot.per_step
    unchanged = [all(torch.equal(steps[i][k], steps[i - 1][k]) for k in steps[i]) for i in range(1, len(steps))]
    return {"error": error, "poisoned": Poison.poisoned, "global_step": trainer.global_step, "unchanged": unchanged,
            "final": steps[-1] if steps else {}}


def _all_cases() -> list[dict[str, Any]]:
    out = []
    for strategy in STRATEGIES:
        out.append(_fit(strategy, "error", (2,)))
        out.append(_fit(strategy, "skip", (2,)))
    out.append(_fit("dp", "skip", (1, 2), max_skips=2))
    out.append(_fit("pp", "skip", (1, 2), max_skips=2))
    return out


def test_nonfinite_gradients_are_one_decision_on_every_rank() -> None:
    results = run_distributed(_all_cases, 2, init_backend=None, timeout=600)
    poisoned = results[0][0]["poisoned"]
    assert poisoned is not None
    for rank, per_rank in enumerate(results):
        for index, strategy in enumerate(STRATEGIES):
            error, skip = per_rank[2 * index], per_rank[2 * index + 1]
            label = f"{strategy} rank {rank}"
            # error: every rank stops at step 2 (two steps done), naming the step and, where rank 0 holds it, the parameter
            assert error["error"] is not None and "step 2" in error["error"], label
            assert "not finite" in error["error"] and "'" in error["error"], label
            assert results[0][2 * index]["poisoned"] in results[rank][2 * index]["error"], label
            assert error["global_step"] == 2, label
            # skip: the poisoned step (third batch) left every parameter as it was; the others moved them
            assert skip["error"] is None and skip["global_step"] == 5, label
            assert skip["unchanged"] == [False, True, False, False], f"{label}: {skip['unchanged']}"
        for case in (-2, -1):
            assert per_rank[case]["error"] is not None and "2 consecutive steps" in per_rank[case]["error"], rank
    for index in range(len(STRATEGIES)):  # the same final parameters on both ranks after a skipped step
        skip0, skip1 = results[0][2 * index + 1]["final"], results[1][2 * index + 1]["final"]
        assert all(bool((skip0[k] == skip1[k]).all()) for k in skip0), STRATEGIES[index]


def test_bad_nonfinite_options_are_typed_errors() -> None:
    import lightning_parallel

    with pytest.raises(ValueError, match=r"`on_nonfinite`='ignore' is invalid.*HINT"):
        lightning_parallel.HybridParallelStrategy(on_nonfinite="ignore")
    with pytest.raises(ValueError, match=r"`max_nonfinite_skips`=0 is invalid"):
        lightning_parallel.HybridParallelStrategy(on_nonfinite="skip", max_nonfinite_skips=0)
    with pytest.raises(TypeError, match=r"`max_nonfinite_skips`='3' is invalid"):
        lightning_parallel.HybridParallelStrategy(max_nonfinite_skips="3")
