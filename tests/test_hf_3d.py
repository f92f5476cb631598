"""``3d`` (tensor x pipeline parallelism, 4 processes) on real Hugging Face models, unchanged.

Tensor parallelism inside traced pipeline stages (``parallel/pipeline/tensor.py``) applies the same
plans as ``tp`` (``parallel/tensor/plan.py``: Conv1D, fused ``c_attn`` / ``qkv_proj`` /
``gate_up_proj``, tied embeddings) to the stages' graphs. Each cell trains 5 steps with clipping
and matches one process (fp32, relative 1e-5); each rank must also really hold only its part
(about a quarter of the parameters under tp2 x pp2), so a plan that splits nothing fails.
The MoE cell is ``pp2 x ep2`` (experts sharded over the two data-parallel pipelines; the
Hugging Face experts modules run as opaque ops in the stages).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.testing.real_models import HFCausalLM
from tests.test_hf_pp import T5, _lm, check_cells

HYBRID = "lightning_parallel:HybridParallelStrategy"
TP2_PP2 = {"class": HYBRID, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}

CELLS: dict[str, tuple[Any, bool]] = {
    "llama tp2 x pp2": (_lm("llama", TP2_PP2, devices=4), False),
    "gpt2 tp2 x pp2 labels= (Conv1D, fused c_attn, tied lm_head)": (_lm("gpt2", TP2_PP2, devices=4, loss="labels"), False),
    "phi3 '3d' (fused qkv_proj, gate_up_proj)": (_lm("phi3", "3d", devices=4), False),
    "mixtral pp2 x ep2": (_lm("mixtral", {"class": HYBRID, "pipeline_parallel_size": 2, "expert_parallel_size": 2},
                              devices=4), False),
    # Its position bias, split with the heads, crosses the cut as each tp rank's shard from the second step on
    # (parallel/pipeline/shard_crossing.py): steps 2-5 check those values and their gradients.
    "t5 tp2 x pp2 labels= (split position bias crossing the cut)": (_lm(T5[0], TP2_PP2, devices=4, loss="labels", config=T5[2]),
                                                                     False),
}


def test_3d_on_real_models_matches_single_process() -> None:
    per_rank = check_cells(CELLS, 4, timeout=900)
    for rank, result in enumerate(per_rank):
        phi3 = result["fits"][2]
        assert phi3["layout"]["dims"] == "pp=2 x dp_replicate=1 x dp_shard=1 x tp=2 (ep=1)", phi3["layout"]
        for family in ("llama", "gpt2", "phi3"):
            total = sum(p.numel() for p in HFCausalLM(family=family).parameters())
            held = result["records"][family]["local_numel"]
            assert held < 0.35 * total, f"rank {rank} {family}: holds {held} of {total} parameter elements"
        assert result["records"]["gpt2"]["tied"]
