"""Real library models wrapped the way their users wrap them, for the model x strategy matrix.

Evidence that a strategy handles "any LightningModule" has to come from the library classes
themselves, not from look-alikes: these modules build ``transformers`` classes from tiny random
configs (offline, nothing downloaded) and wrap them in a plain LightningModule that knows nothing
of parallelism. Each wrapper is written as a Hugging Face user writes it:

* ``HFCausalLM``: ``self.model = AutoModelForCausalLM.from_config(...)``-style construction,
  default config flags kept (``use_cache=True``, tied embeddings where the family ties them),
  ``forward`` returns ``self.model(input_ids=...).logits``; ``loss="labels"`` takes the loss
  from ``self.model(input_ids=x, labels=x).loss`` inside ``training_step`` (a submodule call,
  the most common HF pattern); ``padding=True`` feeds an ``attention_mask`` with left padding
  and ``-100`` labels on the padded positions.
* ``VisionClassifier``: transformers' ``ResNetForImageClassification`` (a ResNet-18 layout of
  basic blocks, convolutions and BatchNorm) or ``ViTForImageClassification``, with
  ``F.cross_entropy`` on the logits. The vision models are transformers' own: torchvision's PyPI
  wheels are CUDA builds whose C extension does not load beside a CPU build of torch, and this
  package patches no other library's import to make them load (a GPU user installs the
  torchvision release built for their torch, e.g. 0.28 for torch 2.13).

Dropout is set to zero in every config: parity with one process needs the same random
stream per element, which no layout that moves elements between ranks can give.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

VOCAB = 64

# Tiny configs per family: 4 heads (2 key/value heads where the family has GQA), width 32, four
# layers so that pp2, pp4 and tp2 x pp2 all find blocks to cut. Every dropout is zero.
_HF_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 64}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"intermediate_size": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 64, "resid_pdrop": 0.0,
                                              "embd_pdrop": 0.0, "attention_dropout": 0.0, "pad_token_id": 0,
                                              "bos_token_id": 0, "eos_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 64,
                                                       "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 64,
                                                           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                                           "num_experts": 4, "num_experts_per_tok": 2,
                                                           "decoder_sparse_step": 1}),
}
HF_FAMILIES = tuple(_HF_FAMILIES)
MOE_FAMILIES = ("mixtral", "qwen2_moe")


def hf_config(family: str, n_layer: int = 4, **overrides: Any) -> Any:
    """The tiny random config of ``family`` (see ``HF_FAMILIES``), with the family's own defaults
    for everything not set here (``use_cache``, ``tie_word_embeddings``, ``attn_implementation``)."""
    import transformers

    if family not in _HF_FAMILIES:
        raise ValueError(f"family={family!r} is not one of {HF_FAMILIES}")
    config_name, _, extra = _HF_FAMILIES[family]
    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4,
                              "num_hidden_layers": n_layer, "max_position_embeddings": 64}
    if family == "gpt2":  # GPT-2 names its sizes differently
        common = {"vocab_size": VOCAB, "n_embd": 32, "n_head": 4, "n_layer": n_layer, "n_positions": 64}
    return getattr(transformers, config_name)(**{**common, **extra, **overrides})


def build_hf_model(family: str, n_layer: int = 4, **overrides: Any) -> nn.Module:
    """A ``transformers`` causal-LM class of ``family`` from its tiny config (random weights)."""
    import transformers

    _, model_name, _ = _HF_FAMILIES[family]
    return getattr(transformers, model_name)(hf_config(family, n_layer, **overrides))


class HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM in a plain LightningModule, as users write it (see module doc).

    ``loss``: ``"logits"`` computes ``F.cross_entropy`` on ``self(x)`` against the batch's next
    tokens; ``"labels"`` takes ``self.model(input_ids=x, labels=x).loss`` (HF shifts inside).
    ``gradient_checkpointing`` calls HF's own ``gradient_checkpointing_enable()``. ``family`` may
    also be ``"ConfigClass/ModelClass"`` (two ``transformers`` names) for a family outside
    ``HF_FAMILIES``: then ``config`` is its whole config (``n_layer`` unused).
    """

    def __init__(self, family: str = "llama", n_layer: int = 4, loss: str = "logits", padding: bool = False,
                 lr: float = 0.5, gradient_checkpointing: bool = False, config: dict[str, Any] | None = None,
                 momentum: float = 0.0) -> None:
        super().__init__()
        if loss not in ("logits", "labels"):
            raise ValueError(f"loss={loss!r} must be 'logits' or 'labels'")
        self.family, self.loss_kind, self.padding, self.lr, self.momentum = family, loss, padding, lr, momentum
        if "/" in family:
            import transformers

            config_name, model_name = family.split("/")
            self.model = getattr(transformers, model_name)(getattr(transformers, config_name)(**(config or {})))
        else:
            self.model = build_hf_model(family, n_layer, **(config or {}))
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _step_loss(self, batch: Any) -> Tensor:
        if self.padding:
            x, mask = batch
            labels = x.masked_fill(mask == 0, -100)
            if self.loss_kind == "labels":
                return self.model(input_ids=x, attention_mask=mask, labels=labels).loss
            logits = self(x, mask)[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        x, y = batch
        if self.loss_kind == "labels":
            return self.model(input_ids=x, labels=x).loss
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._step_loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._step_loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def padded_token_data(num_samples: int = 128, block_size: int = 16, vocab_size: int = VOCAB, seed: int = 0) -> TensorDataset:
    """``(input_ids, attention_mask)`` pairs with left padding of 0-5 tokens per row (pad id 0),
    counting sequences mod ``vocab_size`` elsewhere: what a tokenizer with ``padding_side="left"``
    produces for a batch of unequal texts."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(1, vocab_size, (num_samples, 1), generator=gen)
    ids = (starts + torch.arange(block_size)) % (vocab_size - 1) + 1
    pad = torch.randint(0, 6, (num_samples, 1), generator=gen)
    mask = (torch.arange(block_size) >= pad).long()
    return TensorDataset(ids.masked_fill(mask == 0, 0), mask)


def build_vision_model(arch: str, num_classes: int = 10) -> nn.Module:
    """transformers' ResNet (``"resnet"``: ResNet-18's block layout, basic blocks [2, 2, 2, 2],
    BatchNorm, narrow for 32x32 inputs) or ViT (``"vit"``: 4 layers, 4 heads, width 32, 8x8 patches)."""
    import transformers

    if arch == "resnet":
        config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                           depths=[2, 2, 2, 2], layer_type="basic", num_labels=num_classes)
        return transformers.ResNetForImageClassification(config)
    if arch == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=4, num_attention_heads=4,
                                        hidden_size=32, intermediate_size=64, num_labels=num_classes,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.ViTForImageClassification(config)
    raise ValueError(f"arch={arch!r} must be 'resnet' or 'vit'")


class VisionClassifier(pl.LightningModule):
    """A transformers image classifier in a plain LightningModule: cross-entropy on ``self(x)``, SGD."""

    def __init__(self, arch: str = "resnet", num_classes: int = 10, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.model = build_vision_model(arch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(pixel_values=x).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def image_data(num_samples: int = 64, num_classes: int = 10, size: int = 32, seed: int = 0) -> TensorDataset:
    """Random 3 x ``size`` x ``size`` images labelled by a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 3, size, size, generator=gen)
    teacher = torch.randn(3 * size * size, num_classes, generator=gen)
    return TensorDataset(x, (x.flatten(1) @ teacher).argmax(dim=1))
