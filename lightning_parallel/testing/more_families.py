"""Transformers families outside the original coverage matrix, chosen to span the layouts that
name-based tensor-parallel plans got wrong (issue 26): encoder-only, encoder-decoder, multi-query
and grouped attention with fused per-group-interleaved projections, parallel attention + MLP
blocks, ALiBi, MLA with shared experts and routing biases, experts with biases, and a non-attention mixer.

Each entry is ``(ConfigClass/ModelClass, loss, config)`` for
:class:`~lightning_parallel.testing.real_models.HFCausalLM` (``loss="labels"`` where the model
needs labels to run, i.e. the encoder-decoders, whose decoder inputs come from the labels). Tiny
random configs (width 32, 4 heads, 2 layers where a layer count is given, vocabulary 64) with
every dropout zero, as in :mod:`~lightning_parallel.testing.real_models`.
"""

from __future__ import annotations

from typing import Any

_V = {"vocab_size": 64}
_LM = {**_V, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 64}

MORE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig/BertForMaskedLM", "logits", {
        **_LM, "intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
    "distilbert": ("DistilBertConfig/DistilBertForMaskedLM", "logits", {
        **_V, "dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 64, "max_position_embeddings": 64,
        "dropout": 0.0, "attention_dropout": 0.0}),
    "t5": ("T5Config/T5ForConditionalGeneration", "labels", {
        **_V, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "dropout_rate": 0.0,
        "decoder_start_token_id": 0}),
    "bart": ("BartConfig/BartForConditionalGeneration", "labels", {
        **_V, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": 1, "bos_token_id": 0,
        "eos_token_id": 2, "decoder_start_token_id": 2}),
    # Grouped attention, one fused projection interleaved per key/value group, attention and MLP in parallel.
    "falcon_gqa": ("FalconConfig/FalconForCausalLM", "logits", {
        **_V, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "new_decoder_architecture": True,
        "num_kv_heads": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # Multi-query attention, [q | k | v] fused with unequal parts.
    "gpt_bigcode": ("GPTBigCodeConfig/GPTBigCodeForCausalLM", "logits", {
        **_V, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    # Attention and MLP in parallel from one norm, partial rotary.
    "gptj": ("GPTJConfig/GPTJForCausalLM", "logits", {
        **_V, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 64, "rotary_dim": 4, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "bloom": ("BloomConfig/BloomForCausalLM", "logits", {  # ALiBi, per-head fused query_key_value
        **_V, "hidden_size": 32, "n_head": 4, "n_layer": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "mpt": ("MptConfig/MptForCausalLM", "logits", {  # ALiBi, [q | k | v] fused Wqkv
        **_V, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64, "attn_config": {"attn_pdrop": 0},
        "resid_pdrop": 0.0, "emb_pdrop": 0.0}),
    "opt": ("OPTConfig/OPTForCausalLM", "logits", {
        **_LM, "ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "attention_dropout": 0.0, "pad_token_id": 1,
        "bos_token_id": 2, "eos_token_id": 2}),
    # MLA (low-rank q and kv, decoupled rotary keys), shared experts, routing-score correction biases.
    "deepseek_v3": ("DeepseekV3Config/DeepseekV3ForCausalLM", "logits", {
        **_LM, "intermediate_size": 64, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "attention_dropout": 0.0}),
    # MoE experts with biases, gate and up interleaved, transposed weights; attention sinks, sliding window.
    "gpt_oss": ("GptOssConfig/GptOssForCausalLM", "logits", {
        **_LM, "intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "attention_dropout": 0.0}),
    "mamba": ("MambaConfig/MambaForCausalLM", "logits", {  # a state-space mixer, no attention
        **_V, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}),
}
