"""A GPT-style decoder written the way most hand-written models are (nanoGPT-like).

It is deliberately *ordinary*: separate ``q``/``k``/``v`` Linears, a reshape with the GLOBAL head
count (``view(B, T, self.n_head, C // self.n_head)``), ``F.scaled_dot_product_attention``, a
pre-norm residual ``Block`` in an ``nn.ModuleList`` called ``blocks``, an untied ``lm_head``.
The strategies must parallelise exactly this code, unchanged, so the names below are part of
the contract other modules rely on (tensor-parallel plans, pipeline split points, the MoE
variant):

``tok_emb, pos_emb, drop, blocks.{i}.{ln_1, attn.{q,k,v,proj}, ln_2, mlp.{fc,proj}}, ln_f, lm_head``

Extension points for subclasses (the MoE GPT uses them):
* :meth:`GPT._make_mlp` builds the feed-forward module of layer ``i``; a subclass returns an
  expert layer instead. It runs inside ``GPT.__init__`` after ``self.n_embd``, ``self.n_head``,
  ``self.dropout``, ``self.bias`` and ``self.n_layer`` are set; a subclass's own settings must
  be set on ``self`` before it calls ``super().__init__``.
* :meth:`GPT.compute_loss` (from the base class) may be extended with auxiliary terms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.models.base import ClassificationModule, check_fraction, check_positive_int
from lightning_parallel.errors import config_error


def check_heads(n_embd: int, n_head: int) -> None:
    """Validate the width and global head count: each head gets ``n_embd // n_head`` dims."""
    check_positive_int("n_embd", n_embd)
    check_positive_int("n_head", n_head)
    if n_embd % n_head != 0:
        raise config_error(
            ValueError,
            "n_embd",
            n_embd,
            f"must be divisible by n_head={n_head} (each head gets n_embd // n_head dims)",
            f"pick n_embd as a multiple of {n_head}, e.g. {n_head * max(1, round(n_embd / n_head))}",
        )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections.

    ``n_head`` is the global head count and the reshape uses it (not ``-1``), as most user code
    does; tensor parallelism must cope with that rather than require a rewrite.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        check_heads(n_embd, n_head)
        self.n_embd = n_embd
        self.n_head = n_head
        self.dropout = check_fraction("dropout", dropout)
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q = self.q(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The transformer feed-forward: ``fc`` (C -> 4C), GELU, ``proj`` (4C -> C), dropout."""

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    ``mlp`` may be any module mapping ``(B, T, C)`` to ``(B, T, C)``; GPT passes what
    :meth:`GPT._make_mlp` returns, which is how an MoE layer takes the MLP's place.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = mlp if mlp is not None else MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(ClassificationModule):
    """Decoder-only language model: ``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``.

    Batches are ``(idx, targets)`` with targets = idx shifted by one; the loss is the mean
    next-token cross-entropy and ``*_acc`` the next-token accuracy. Initialisation follows
    GPT-2 (normal(0, 0.02), zero biases, output projections scaled by ``1/sqrt(2 n_layer)``)
    and draws from the global RNG only, so ``seed_everything`` makes it reproducible.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        for field, value in (("block_size", block_size), ("n_layer", n_layer)):
            check_positive_int(field, value)
        check_heads(n_embd, n_head)
        check_fraction("dropout", dropout)
        if not isinstance(bias, bool):
            raise config_error(TypeError, "bias", bias, "must be a bool", "pass bias=true or bias=false")
        super().__init__(vocab_size, lr, optimizer, momentum, weight_decay, eps)
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = float(dropout)
        self.bias = bias
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, dropout, bias, mlp=self._make_mlp(i)) for i in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                # GPT-2: residual-branch outputs scaled so the residual stream's variance
                # does not grow with depth.
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        """Feed-forward module of layer ``layer_idx``; override to use experts (MoE) instead."""
        return MLP(self.n_embd, self.dropout, self.bias)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 style init for Linear and Embedding; LayerNorm keeps its (1, 0) default."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.size()
        if T > self.block_size:
            raise config_error(
                ValueError,
                "idx.shape[1]",
                T,
                f"a sequence may not be longer than block_size={self.block_size}",
                "crop the input or build the model with a larger block_size",
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def compute_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Next-token cross-entropy over all ``B*T`` positions."""
        V = logits.size(-1)
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))
