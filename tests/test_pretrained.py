"""Pretrained Hugging Face weights into sharded layouts give the single-process logits.

A real tiny ``LlamaForCausalLM`` is saved with ``save_pretrained(..., max_shard_size=...)``
(several safetensors shards and an index). The reference is ``from_pretrained`` in one process
(transformers' own loader). Under ``zero3``, ``tp``, dp2 x pp2 and ``3d`` the unchanged ``HFCausalLM`` is built under
``Trainer.init_module(empty_init=True)`` and given the directory by the ``PretrainedWeights``
callback: after the layout each rank reads only the slices it holds (checked by the bytes it
read), and the laid-out model's parameters and logits equal the reference. A tiny
``MixtralForCausalLM`` (checkpoint: one tensor per expert and projection; model: fused
``experts.gate_up_proj`` / ``down_proj``) goes through transformers' conversion mapping, in one
process and under ``ep`` and ``tp``, where a rank reads only its experts or its rows of them.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel import PretrainedWeights, load_pretrained
from lightning_parallel.pretrained import _Reader
from lightning_parallel.pretrained_convert import Source, take
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


def _assert_loaded(results: list[list[dict[str, Any]]], cases: Any, references: list[Any]) -> None:
    """Every rank under every case: ``from_pretrained``'s parameters and logits, having read at
    most its share of the checkpoint's bytes (and, where measured, exactly the bytes it holds)."""
    for rank, per_case in enumerate(results):
        for (name, share), (params, logits), seen in zip(cases, references, per_case):
            total = sum(p.numel() * p.element_size() for p in params.values())
            assert seen["params"].keys() == params.keys()
            for key, value in params.items():
                assert torch.equal(seen["params"][key], value), f"{name} rank {rank}: {key}"
            torch.testing.assert_close(seen["logits"], logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
            assert seen["read"] <= share * total, f"{name} rank {rank} read {seen['read']} of {total} bytes"
            held = seen.get("held", seen["read"])
            assert held == seen["read"], f"{name} rank {rank}: read {seen['read']} bytes, holds {held}"


def _held_bytes(module: torch.nn.Module, only: str = "") -> int:
    """Bytes of the checkpointed tensors this rank holds (its local shards), tied ones once."""
    unique = {id(t): t for name, t in module.state_dict(keep_vars=True).items() if only in name}
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in unique.values())


def run_loaded(cases: list[tuple[str, str, str]], devices: int) -> list[dict[str, Any]]:
    """One rank: per (strategy, family, path), a meta-built HFCausalLM + PretrainedWeights; logits,
    params, bytes read and bytes held (all tensors, and the experts alone) at train start."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_parallel.testing.parity import token_data

    out = []
    for strategy, family, path in cases:
        seen: dict[str, Any] = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any, seen: dict[str, Any] = seen) -> None:
                with torch.no_grad():
                    seen["logits"] = trainer.strategy.model(INPUT).detach().clone()
                seen["params"] = {k.removeprefix("model."): v for k, v in full_parameters(pl_module).items()}
                seen["read"] = pl_module.model.__dict__["_lp_pretrained_stats"]["bytes_read"]
                seen["held"], seen["experts"] = _held_bytes(pl_module.model), _held_bytes(pl_module.model, ".experts.")

        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[PretrainedWeights(path, submodule="model"), Probe()])
        with trainer.init_module(empty_init=True):
            model = HFCausalLM(family=family)
        trainer.fit(model, DataLoader(token_data(16), batch_size=4))
        out.append(seen)
    return out


def run_fsdp_wrapped(path: str) -> dict[str, Any]:
    """One rank (process group left by the Trainer runs): a meta-built MixtralForCausalLM that FSDP2
    wraps itself, so its class becomes ``FSDPMixtralForCausalLM`` (to transformers: custom code,
    no conversion mapping); the load was asked for before, on the model as built."""
    from torch.distributed.fsdp import fully_shard

    from lightning_parallel.pretrained import run_pending_loads

    with torch.device("meta"):
        model = build_hf_model("mixtral")
    load_pretrained(model, path)
    model.to_empty(device="cpu")
    fully_shard(model)
    run_pending_loads(model)
    return {"class": type(model).__name__, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "read": model.__dict__["_lp_pretrained_stats"]["bytes_read"], "held": _held_bytes(model)}


def run_loaded_and_wrapped(cases: list[tuple[str, str, str]], devices: int, wrapped: str) -> list[dict[str, Any]]:
    """One rank: :func:`run_loaded`'s cases, then :func:`run_fsdp_wrapped` in the same processes (no extra spawn)."""
    return [*run_loaded(cases, devices), run_fsdp_wrapped(wrapped)]


def test_sharded_safetensors_into_zero3_tp_and_ep_give_single_process_logits(tmp_path: Path) -> None:
    """Llama under zero3 and tp2; Mixtral (per-expert checkpoint, fused model) under ep2 and tp2
    (``gate_up_proj`` packed ``_StridedShard``); Phi-3 under tp2 (``qkv_proj`` stored in rank order:
    a rank's rows are three runs of the file's tensor): every rank reads exactly the bytes it holds."""
    llama, mixtral = _save("llama", tmp_path / "llama"), _save("mixtral", tmp_path / "mixtral")
    assert len(list(llama.glob("*.safetensors"))) > 2 and (llama / "model.safetensors.index.json").is_file()
    phi3 = _save("phi3", tmp_path / "phi3")  # its qkv_proj stored in rank order: three runs of rows per rank
    runs = (("zero3", llama, 0.6), ("tp", llama, 0.65), ("ep", mixtral, 0.6), ("tp", mixtral, 0.55), ("tp", phi3, 0.65))
    references = [_reference(path) for _, path, _ in runs]
    total_mixtral = sum(v.nbytes for v in references[2][0].values())
    cases = [(strategy, path.name, str(path)) for strategy, path, _ in runs]
    results = run_distributed(run_loaded_and_wrapped, 2, cases, 2, str(mixtral), init_backend=None, timeout=400)
    _assert_loaded([r[:-1] for r in results], [(f"{s} {p.name}", share) for s, p, share in runs], references)
    expert_total = sum(v.nbytes for k, v in references[2][0].items() if ".experts." in k)
    for per_case in results:  # ep and tp: each rank holds (and so read) half of every layer's experts
        assert [per_case[i]["experts"] for i in (2, 3)] == [expert_total // 2] * 2, per_case
        wrapped = per_case[-1]
        assert wrapped["class"] == "FSDPMixtralForCausalLM" and wrapped["read"] == wrapped["held"] < 0.6 * total_mixtral
        assert all(torch.equal(wrapped["params"][k], v) for k, v in references[2][0].items())


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
    cases = (("dp2 x pp2", {"class": "lightning_parallel:HybridParallelStrategy", "pipeline_parallel_size": 2}, 0.65),
             ("3d", "3d", 0.4))
    results = run_distributed(run_predicted, 4, str(path), [s for _, s, _ in cases], 4, init_backend=None, timeout=400)
    assert "tp=2" in results[0][1]["dims"] and "pp=2" in results[0][1]["dims"], results[0][1]["dims"]
    _assert_loaded(results, [(name, share) for name, _, share in cases], [(params, logits)] * len(cases))


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


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_per_expert_checkpoint_loads_into_fused_experts_in_one_process(tmp_path: Path, family: str) -> None:
    """transformers 5 writes (and the Hub stores) one tensor per expert and projection; the model
    holds them fused. Loaded through transformers' conversion mapping: ``from_pretrained``'s
    parameters and logits, every byte of the checkpoint read once."""
    path = _save(family, tmp_path / family)
    assert any(".experts.0." in key for key in (path / "model.safetensors.index.json").read_text().split('"'))
    params, logits = _reference(path)
    torch.manual_seed(8)
    model = build_hf_model(family)
    load_pretrained(model, path)
    assert dict(model.named_parameters()).keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=INPUT).logits, logits, rtol=0, atol=0)
    assert model.__dict__["_lp_pretrained_stats"]["bytes_read"] == sum(v.nbytes for v in params.values())


def test_boxes_of_converted_tensors_read_only_their_sources(tmp_path: Path) -> None:
    """A box of ``cat([stack(a), stack(b)], 1)`` (what MergeModulelist + Concatenate build) reads only
    the experts and rows it covers, also for a packed tensor-parallel box (rows of a and of b);
    another op (a transpose) reads its sources whole and still gives the box."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {f"e.{i}.{w}": torch.randn(6, 4, generator=gen) for i in range(5) for w in "ab"}
    save_file(tensors, tmp_path / "w.safetensors")
    eager = torch.cat([torch.stack([tensors[f"e.{i}.{w}"] for i in range(5)]) for w in "ab"], dim=1)
    box = (((1, 3),), ((2, 4), (8, 10)), ((0, 4),))  # experts 1-2; rows 2-3 of a and of b (_StridedShard(1, 2))
    with ExitStack() as stack:
        reader = _Reader(tmp_path / "w.safetensors", stack)
        fused = torch.cat([torch.stack([Source(reader, f"e.{i}.{w}") for i in range(5)]) for w in "ab"], dim=1)
        assert fused.shape == tuple(eager.shape)
        assert torch.equal(fused.read(box), take(eager, box))
        assert reader.bytes_read == 2 * 4 * 4 * 4  # 2 experts x 4 rows x 4 columns x fp32
        reader.bytes_read = 0
        turned, turned_box = fused.transpose(1, 2), (box[0], box[2], box[1])
        assert turned.shape == (5, 4, 12)
        assert torch.equal(turned.read(turned_box), take(eager.transpose(1, 2), turned_box))
        assert reader.bytes_read == eager.nbytes


def test_moe_checkpoint_errors_name_target_and_sources(tmp_path: Path) -> None:
    path = _save("mixtral", tmp_path / "mixtral")
    with pytest.raises(ValueError, match=r"experts.gate_up_proj', \(8, 128, 32\), \(4, 128, 32\), "
                                         r"'model.layers.0.block_sparse_moe.experts.0.w1.weight .*\(8 tensors\).*HINT: build"):
        load_pretrained(build_hf_model("mixtral", num_local_experts=8), path)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.2.block_sparse_moe.experts.0.w1.weight'"):
        load_pretrained(build_hf_model("mixtral", n_layer=2), path)
    load_pretrained(build_hf_model("mixtral", n_layer=2), path, strict=False)
