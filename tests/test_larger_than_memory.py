"""examples/larger_than_memory.py, the demonstration in docs/memory.md ("Larger than this
machine"), at a tiny size so it cannot rot: the meta-built GPT trains under ``zero3`` and ``pp`` (both in one spawned
group), every rank holds only its part, losses are finite and the per-rank report prints."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_parallel.testing import run_distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "larger_than_memory.py"
SHAPE = {"layers": 2, "width": 64, "heads": 1, "vocab": 128, "block": 16, "steps": 3}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("larger_than_memory", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _both(devices: int) -> list[tuple[dict[str, Any], str]]:
    example = _example()
    out = []
    for strategy in ("zero3", "pp"):
        result = example.train(strategy, devices=devices, **SHAPE)
        out.append((result, example.describe(strategy, result)))
    return out


def test_larger_than_memory_example_trains_under_zero3_and_pp() -> None:
    devices = 2
    results = run_distributed(_both, devices, devices, init_backend=None, timeout=300)
    whole = results[0][0][0]["params"] * 4  # fp32 bytes of the whole model
    for rank, per_rank in enumerate(results):
        for (result, line), strategy in zip(per_rank, ("zero3", "pp")):
            assert len(result["losses"]) == SHAPE["steps"], (strategy, result)
            assert all(math.isfinite(v) for v in result["losses"]), (strategy, result["losses"])
            # the layout's part only: zero3 a 1/2 shard, pp2 one stage (one block and an embedding or the head)
            assert 0 < result["params_held"] < 0.75 * whole, (strategy, rank, result["params_held"], whole)
            assert 0 < result["grads_held"] <= result["params_held"], (strategy, rank, result)
            assert line.startswith(f"{strategy} rank {result['rank']}: ") and "peak RSS" in line, line
    # both strategies train the same model from the same seed: first losses agree (the same initial weights)
    for rank_results in results:
        assert abs(rank_results[0][0]["losses"][0] - rank_results[1][0]["losses"][0]) < 1e-4, rank_results


def test_embeddings_and_head_get_fsdp_units_of_their_own() -> None:
    """zero3's root unit stays gathered for the whole step: ``outer_units`` takes the embeddings and the
    head out of it (tied ones as one group, only embedding groups resharding after forward), and
    leaves small modules (position tables, norms; under a quarter of a block) in the root. (That tensor-parallel ones stay there too
    needs a process group; not checked here.)"""
    import torch

    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.parallel.blocks import find_repeated_blocks
    from lightning_parallel.parallel.data.apply import outer_units
    from lightning_parallel.testing.real_models import HFCausalLM

    def units(model: torch.nn.Module) -> list[tuple[list[str], bool]]:
        names = {id(m): n for n, m in model.named_modules()}
        blocks = [b for _, b in find_repeated_blocks(model)]
        return [([names[id(m)] for m in group], reshards) for group, reshards in outer_units(model, blocks)]

    with torch.device("meta"):
        gpt = GPT(vocab_size=1024, block_size=16, n_layer=4, n_head=4, n_embd=128)
        small_vocab = GPT(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=128)
        tied = HFCausalLM(family="gpt2", config={"vocab_size": 1024})
    assert units(gpt) == [(["tok_emb"], True), (["lm_head"], False)]  # 131k each; pos_emb (2k of a 198k block) stays
    assert units(small_vocab) == []  # 33k each, under a quarter of a block: a unit would cost more than it saves
    assert units(tied) == [(["model.transformer.wte", "model.lm_head"], False)]  # wpe (2k of a 13k block) stays


def test_sublayer_units_are_a_blocks_attention_and_mlp() -> None:
    """``fsdp_units="sublayer"``: the children holding at least a quarter of a block's parameters,
    found through a single-child wrapper (activation checkpointing's); norms stay in the block unit."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.parallel.blocks import find_repeated_blocks
    from lightning_parallel.parallel.data.apply import sublayer_units
    from lightning_parallel.testing.real_models import HFCausalLM

    def parts(model: torch.nn.Module, wrap: bool = False) -> list[list[str]]:
        out = []
        for _, block in find_repeated_blocks(model):
            target = checkpoint_wrapper(block) if wrap else block
            names = {id(m): n for n, m in target.named_modules()}
            out.append([names[id(m)].split(".")[-1] for m in sublayer_units(target)])
        return out

    with torch.device("meta"):
        gpt = GPT(vocab_size=256, block_size=16, n_layer=3, n_head=4, n_embd=64)
        llama = HFCausalLM(family="llama")
    assert parts(gpt) == [["attn", "mlp"]] * 3
    assert parts(gpt, wrap=True) == [["attn", "mlp"]] * 3
    layers = len(find_repeated_blocks(llama))
    assert layers >= 2 and parts(llama) == [["self_attn", "mlp"]] * layers
