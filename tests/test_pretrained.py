"""Pretrained Hugging Face weights into sharded layouts give the single-process logits.

A real tiny ``LlamaForCausalLM`` is saved with ``save_pretrained(..., max_shard_size=...)``
(several safetensors shards and an index). The reference is ``from_pretrained`` in one process
(transformers' own loader). Under ``zero3``, ``tp``, dp2 x pp2 and ``3d`` the unchanged ``HFCausalLM`` is built under
``Trainer.init_module(empty_init=True)`` and given the directory by the ``PretrainedWeights``
callback: after the layout each rank reads only the slices it holds (checked by the bytes it
read), and the laid-out model's parameters and logits equal the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel import PretrainedWeights, load_pretrained
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import full_parameters
from lightning_parallel.testing.real_models import HFCausalLM, build_hf_model

INPUT = torch.arange(32).reshape(2, 16) % 64


def _save(family: str, path: Path, **kwargs: Any) -> Path:
    torch.manual_seed(7)
    build_hf_model(family).save_pretrained(path, max_shard_size="20KB", **kwargs)
    return path


def _reference(path: Path, inputs: torch.Tensor = INPUT) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return {n: p.detach().clone() for n, p in model.named_parameters()}, model(input_ids=inputs).logits


def _assert_loaded(results: list[list[dict[str, Any]]], cases: Any, params: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
    """Every rank under every strategy: ``from_pretrained``'s parameters and logits, having read at
    most its share of the checkpoint's bytes."""
    total = sum(p.numel() * p.element_size() for p in params.values())
    for rank, per_strategy in enumerate(results):
        for (strategy, share), seen in zip(cases, per_strategy):
            assert seen["params"].keys() == params.keys()
            for name, value in params.items():
                assert torch.equal(seen["params"][name], value), f"{strategy} rank {rank}: {name}"
            torch.testing.assert_close(seen["logits"], logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{strategy}: {m}")
            assert seen["read"] <= share * total, f"{strategy} rank {rank} read {seen['read']} of {total} bytes"


def run_loaded(path: str, strategies: list[str], devices: int) -> list[dict[str, Any]]:
    """One rank: per strategy, a meta-built HFCausalLM + PretrainedWeights; logits and params at train start."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_parallel.testing.parity import token_data

    out = []
    for strategy in strategies:
        seen: dict[str, Any] = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any, seen: dict[str, Any] = seen) -> None:
                with torch.no_grad():
                    seen["logits"] = trainer.strategy.model(INPUT).detach().clone()
                seen["params"] = {k.removeprefix("model."): v for k, v in full_parameters(pl_module).items()}
                seen["read"] = pl_module.model.__dict__["_lp_pretrained_stats"]["bytes_read"]

        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[PretrainedWeights(path, submodule="model"), Probe()])
        with trainer.init_module(empty_init=True):
            model = HFCausalLM(family="llama")
        trainer.fit(model, DataLoader(token_data(16), batch_size=4))
        out.append(seen)
    return out


def test_sharded_safetensors_into_zero3_and_tp_give_single_process_logits(tmp_path: Path) -> None:
    path = _save("llama", tmp_path / "llama")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    params, logits = _reference(path)
    cases = (("zero3", 0.6), ("tp", 0.65))
    results = run_distributed(run_loaded, 2, str(path), [s for s, _ in cases], 2, init_backend=None, timeout=400)
    _assert_loaded(results, cases, params, logits)


def run_predicted(path: str, strategies: list[Any], devices: int) -> list[dict[str, Any]]:
    """One rank: per strategy, a meta-built HFCausalLM + PretrainedWeights, then ``trainer.predict``
    (pipelines build their stages from the first batch: the load waits for them): the logits, the
    full parameters (from the ranks keeping them) and the bytes this rank read."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_parallel.testing.parity import _make_strategy

    out = []
    for strategy in strategies:
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=_make_strategy(strategy), logger=False,
                             enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                             callbacks=[PretrainedWeights(path, submodule="model")])
        with trainer.init_module(empty_init=True):
            model = HFCausalLM(family="llama")
        logits = trainer.predict(model, DataLoader(list(BATCH), batch_size=len(BATCH)))
        driver = trainer.strategy._pipeline
        params = driver.gather_state(parameters_only=True) if driver is not None else full_parameters(model)
        out.append({"logits": logits[0], "params": {k.removeprefix("model."): v for k, v in params.items()},
                    "read": model.model.__dict__["_lp_pretrained_stats"]["bytes_read"],
                    "dims": trainer.strategy.parallel_dims.describe()})
    return out


BATCH = torch.arange(64).reshape(4, 16) % 64


def test_sharded_safetensors_into_pipelines_and_3d_give_single_process_logits(tmp_path: Path) -> None:
    """dp2 x pp2 and '3d' (tp2 x pp2 on 4 ranks): each rank reads only its stage's slices."""
    path = _save("llama", tmp_path / "llama")
    params, logits = _reference(path, BATCH)
    cases = (({"class": "lightning_parallel:HybridParallelStrategy", "pipeline_parallel_size": 2}, 0.65), ("3d", 0.4))
    results = run_distributed(run_predicted, 4, str(path), [s for s, _ in cases], 4, init_backend=None, timeout=400)
    assert "tp=2" in results[0][1]["dims"] and "pp=2" in results[0][1]["dims"], results[0][1]["dims"]
    _assert_loaded(results, cases, params, logits)


def test_tied_gpt2_and_torch_state_dict_load_in_one_process(tmp_path: Path) -> None:
    path = _save("gpt2", tmp_path / "gpt2")
    params, logits = _reference(path)
    model = build_hf_model("gpt2")
    load_pretrained(model, path)  # real tensors: loaded at once
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in params.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / "weights.pt")
    other = build_hf_model("gpt2")
    load_pretrained(other, tmp_path / "weights.pt")  # bf16 file into fp32 parameters: cast on the slice
    for name, value in other.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_bad_sources_are_typed_errors(tmp_path: Path) -> None:
    path = _save("llama", tmp_path / "llama")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_pretrained(build_hf_model("llama"), tmp_path / "nowhere")
    with pytest.raises(KeyError, match=r"missing \['model.lm_head.weight'.*HINT: pass the submodule"):
        load_pretrained(HFCausalLM(family="llama"), path)  # the LightningModule, not self.model
    with torch.device("meta"):
        model = build_hf_model("llama")
    load_pretrained(model, path)  # deferred: nothing materialises this meta model
    with pytest.raises(RuntimeError, match="still waits for its pretrained weights"):
        model(input_ids=INPUT)
