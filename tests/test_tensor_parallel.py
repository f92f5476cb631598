"""Tensor parallelism, pure torch, multi-process (gloo): parity with one process, and bad input.

Every rank builds the model from the same seed, keeps an untouched copy as the single-process
reference, applies TP in place and trains both for 5 SGD steps on the same global batch. The
losses and every parameter (``DTensor.full_tensor()``) must agree to a relative 1e-5; the
local shards must really be split (a plan that silently replicated everything would pass
parity otherwise). All cases of one TP size share one spawned run (process start-up dominates).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_parallel.testing import run_distributed

STEPS = 5
REL_TOL = 1e-5
# Tensors whose norm is below this are float noise of a gradient that is exactly zero in exact
# arithmetic (the key bias: softmax ignores a constant added to every key); their error is
# measured against this floor instead of their own size.
NORM_FLOOR = 1e-4

# (case id, model kind, sequence_parallel)
CASES = [
    ("seed_mlp", "seed_mlp", False),
    ("gpt", "gpt", False),
    ("llama_gqa_inferred", "llama", False),
    ("llama_gqa_declared", "llama_declared", False),
    ("gpt_sequence_parallel", "gpt", True),
    ("llama_sequence_parallel", "llama_declared", True),
]


def _build(kind: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (seeded) and one fixed global batch."""
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.models.llama import Llama
    from lightning_parallel.models.mlp import SeedMLP

    torch.manual_seed(1234)
    if kind == "seed_mlp":
        return SeedMLP(lr=0.05), (torch.randn(16, 1000), torch.randint(0, 10, (16,)))
    tokens = torch.randint(0, 64, (4, 9))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if kind == "gpt":
        return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, lr=0.5), batch
    # Grouped-query attention: 8 query heads share 4 key/value heads (divisible by tp 2 and 4).
    llama = Llama(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, declare_tp_plan=kind == "llama_declared", lr=0.5,
    )
    return llama, batch


def _train(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """What Lightning's loop does with this module: forward once, the module's loss, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=model.lr)
    losses = []
    for _ in range(STEPS):
        inputs, targets = batch
        loss = model.compute_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _parity_worker(cases: list[tuple[str, str, bool]]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.parallel.clip import total_norm
    from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    results: dict[str, Any] = {}
    # Bad input is refused on every rank before any collective (a plan for another TP size).
    model, _ = _build("gpt")
    try:
        apply_tensor_parallel(model, mesh, resolve_tp_plan(model, tp * 2), sequence_parallel=False)
        results["wrong_plan_error"] = None
    except ValueError as err:
        results["wrong_plan_error"] = str(err)
    try:
        mlp, _ = _build("seed_mlp")
        apply_tensor_parallel(mlp, mesh, resolve_tp_plan(mlp, tp), sequence_parallel=True)
        results["mlp_sp_error"] = None
    except ValueError as err:
        results["mlp_sp_error"] = str(err)
    for case_id, kind, sp in cases:
        model, batch = _build(kind)
        reference = copy.deepcopy(model)
        names_before = [n for n, _ in model.named_parameters()]
        plan = resolve_tp_plan(model, tp)
        apply_tensor_parallel(model, mesh, plan, sequence_parallel=sp)
        losses, ref_losses = _train(model, batch), _train(reference, batch)
        # The last step's gradients are still there: they must have their parameter's layout
        # (sequence parallelism makes norm-weight grads Partial, the embedding's Replicate), and
        # the global-norm clipping norm computed from them must be the single-process norm.
        grad_layouts = {
            n: (str(p.grad.placements), str(p.placements))
            for n, p in model.named_parameters() if isinstance(p, DTensor) and p.grad is not None
        }
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        errors: dict[str, float] = {}
        local_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            ref = ref_params[name].detach()
            errors[name] = ((full - ref).norm() / max(ref.norm().item(), NORM_FLOOR)).item()
            local = param.to_local() if isinstance(param, DTensor) else param
            local_shapes[name] = (tuple(local.shape), tuple(ref.shape))
        results[case_id] = {
            "source": plan.source,
            "losses": losses,
            "ref_losses": ref_losses,
            "errors": errors,
            "local_shapes": local_shapes,
            "names_same": names_before == [n for n, _ in model.named_parameters()],
            "styles": dict(plan.styles),
            "grad_layouts": grad_layouts,
            "clip_norm": (float(total_norm(list(model.parameters()))), float(ref_norm)),
        }
    return results


def _sharded_dim(style: str, param_name: str) -> int | None:
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
        return 0
    return 1 if style == "rowwise" and param_name == "weight" else None


def _check_case(result: dict[str, Any], tp: int, kind: str) -> None:
    assert result["names_same"], "parameter names (FQNs) changed"
    expected_source = "declared" if kind == "llama_declared" else "inferred"
    assert result["source"] == expected_source
    for step, (got, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: loss {got} vs single-process {ref}"
    assert result["losses"][-1] < result["losses"][0], "the model did not train"
    worst = max(result["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] <= REL_TOL, f"parameter {worst[0]} differs from single-process by {worst[1]:.2e} (relative)"
    sharded = 0
    for name, (local, full) in result["local_shapes"].items():
        module_name, _, local_name = name.rpartition(".")
        dim = _sharded_dim(result["styles"].get(module_name, "replicate"), local_name)
        expected = list(full)
        if dim is not None:
            expected[dim] //= tp
            sharded += 1
        assert list(local) == expected, f"{name}: local shard {local}, expected {tuple(expected)}"
    assert sharded >= 3, "almost nothing was sharded"
    wrong = {n: layouts for n, layouts in result["grad_layouts"].items() if layouts[0] != layouts[1]}
    assert result["grad_layouts"] and not wrong, f"gradient placements differ from their parameters' (grad, param): {wrong}"
    got, ref = result["clip_norm"]
    assert abs(got - ref) <= REL_TOL * ref, f"global gradient norm {got} vs single-process {ref}"


def _run(tp: int) -> dict[str, Any]:
    return run_distributed(_parity_worker, tp, CASES, timeout=240)[0]


@pytest.fixture(scope="module")
def tp2_results() -> dict[str, Any]:
    return _run(2)


@pytest.mark.parametrize(("case_id", "kind", "sp"), CASES, ids=[c[0] for c in CASES])
def test_parity_tp2(tp2_results: dict[str, Any], case_id: str, kind: str, sp: bool) -> None:
    _check_case(tp2_results[case_id], 2, kind)


def test_bad_input_is_refused_before_any_collective(tp2_results: dict[str, Any]) -> None:
    assert tp2_results["wrong_plan_error"] is not None and "tensor-parallel mesh size 2" in tp2_results["wrong_plan_error"]
    assert tp2_results["mlp_sp_error"] is not None and "no nn.Embedding" in tp2_results["mlp_sp_error"]


@pytest.mark.slow
def test_parity_tp4() -> None:
    results = _run(4)
    for case_id, kind, _ in CASES:
        _check_case(results[case_id], 4, kind)
