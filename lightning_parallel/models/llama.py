"""A small Llama-style decoder with Hugging Face naming, as a plain LightningModule.

Why it exists: most models people fine-tune follow the Hugging Face layout (``embed_tokens``,
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head``) and many declare a tensor-parallel plan the Hugging Face way. This model has that
layout and code shape (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention through
``repeat_kv``, a reshape with ``-1`` heads, an explicit causal mask instead of ``is_causal``), so
the planners and the tensor-parallel layer are tested against what they will meet, without a
``transformers`` dependency. Nothing here knows about meshes or DTensors.

``declare_tp_plan=True`` declares the plan like ``LlamaForCausalLM`` does: a
``config.base_model_tp_plan`` for the decoder layers and ``_tp_plan`` for the embedding and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.models.base import ClassificationModule, check_positive_int
from lightning_parallel.errors import config_error

BASE_MODEL_TP_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
"""The decoder-layer plan, spelled as Hugging Face's Llama config spells it."""


@dataclass
class LlamaConfig:
    """The sizes, under Hugging Face's names (so ``config.num_attention_heads`` etc. read as usual)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    base_model_tp_plan: dict[str, str] | None = field(default=None)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 like Llama's."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding on ``(B, heads, T, head_dim)`` queries and keys."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``(B, kv_heads, T, D)`` -> ``(B, kv_heads * n_rep, T, D)``: each k/v head serves n_rep queries."""
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention; reshapes with ``-1`` heads as Hugging Face's code does."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        c = config.hidden_size
        self.q_proj = nn.Linear(c, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c, bias=False)

    def forward(self, hidden_states: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        n_rep = self.num_heads // self.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        t = hidden_states.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=hidden_states.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(ClassificationModule):
    """Decoder-only LM: ``forward(input_ids (B, T) int64) -> logits (B, T, vocab_size)``.

    Batches are ``(input_ids, targets)``; training logs ``train_loss`` with ``sync_dist=True``
    and SGD is the default optimizer (see :class:`ClassificationModule`).
    """

    base_model_prefix = ""

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        max_position_embeddings: int = 64,
        rope_theta: float = 10000.0,
        declare_tp_plan: bool = False,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        kv_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        for name, value in (
            ("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
            ("num_hidden_layers", num_hidden_layers), ("num_attention_heads", num_attention_heads),
            ("num_key_value_heads", kv_heads), ("max_position_embeddings", max_position_embeddings),
        ):
            check_positive_int(name, value)
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise config_error(
                ValueError, "hidden_size", hidden_size,
                f"must split into num_attention_heads={num_attention_heads} heads of even size (rotary embedding)",
                "choose hidden_size = heads * an even head size, e.g. 64 with 4 heads",
            )
        if num_attention_heads % kv_heads:
            raise config_error(
                ValueError, "num_key_value_heads", kv_heads,
                f"must divide num_attention_heads={num_attention_heads} (each k/v head serves a group of queries)",
                "use a divisor of num_attention_heads (equal for plain multi-head attention)",
            )
        if not isinstance(declare_tp_plan, bool):
            raise config_error(TypeError, "declare_tp_plan", declare_tp_plan, "must be a bool", "pass true or false")
        super().__init__(vocab_size, lr, optimizer, momentum, weight_decay, eps)
        self.save_hyperparameters()
        self.config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
            base_model_tp_plan=dict(BASE_MODEL_TP_PLAN) if declare_tp_plan else None,
        )
        if declare_tp_plan:
            self._tp_plan = {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"}
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.config) for _ in range(num_hidden_layers))
        self.norm = RMSNorm(hidden_size, self.config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def rotary(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos/sin tables ``(T, head_dim)``, recomputed per call (tiny, and never stale on device moves)."""
        hd = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        if t > self.config.max_position_embeddings:
            raise config_error(
                ValueError, "input_ids.shape[1]", t,
                f"a sequence may not be longer than max_position_embeddings={self.config.max_position_embeddings}",
                "crop the input or build the model with a larger max_position_embeddings",
            )
        cos, sin = self.rotary(t, input_ids.device)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
