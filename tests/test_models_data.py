"""Single-process tests of the model and data zoo: layout, determinism, errors, and learning.

The models are what the strategies must train unchanged, so these tests pin down the names and
behaviour other modules rely on (GPT parameter names, the global head count, one forward per
step) and prove that every model really learns on its data set in a plain Lightning Trainer:
a parity test against a model that cannot learn would prove nothing.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.data import (
    CharCorpusData,
    DigitsData,
    SplitDataModule,
    SyntheticClassificationData,
    SyntheticTokensData,
    decode,
    encode,
)
from lightning_parallel.data.char_corpus import FILE_SEPARATOR, UNKNOWN_CODE
from lightning_parallel.models import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    DeepBlock,
    DeepMLP,
    LargeMLP,
    MLPClassifier,
    SeedMLP,
)
from lightning_parallel.models.mlp import LARGE_DIMS, SEED_DIMS


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Any:
    """Tiny models on a shared 2-core machine: with 2 intra-op threads each small op waits for
    a busy core, measured 25x slower than with 1 under load. Restored after this module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_gpt(**overrides: Any) -> GPT:
    kwargs: dict[str, Any] = dict(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)
    kwargs.update(overrides)
    return GPT(**kwargs)


def trainer(max_steps: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def materialize(dataset: Any) -> tuple[Tensor, Tensor]:
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(xs), torch.stack(ys)


def linear_widths(seq: nn.Sequential) -> list[int]:
    linears = [m for m in seq if isinstance(m, nn.Linear)]
    return [linears[0].in_features] + [m.out_features for m in linears]


# ----------------------------------------------------------------------------- MLPs


def test_mlp_classifier_layout_and_shapes() -> None:
    m = MLPClassifier(dims=[64, 32, 16, 10], activation="gelu")
    assert linear_widths(m.net) == [64, 32, 16, 10]
    assert [type(x) for x in m.net] == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
    assert m(torch.randn(5, 64)).shape == (5, 10)

    seed = SeedMLP()
    assert linear_widths(seed.net) == list(SEED_DIMS) == [1000, 500, 100, 10]
    assert seed(torch.randn(2, 1000)).shape == (2, 10)
    large = LargeMLP()
    assert linear_widths(large.net) == list(LARGE_DIMS) == [10000, 5000, 2000, 1000, 500, 10]
    assert large(torch.randn(2, 10000)).shape == (2, 10)


def test_deep_mlp_has_discoverable_repeated_blocks_and_stable_activations() -> None:
    torch.manual_seed(0)
    m = DeepMLP()  # the seeds' 100 layers
    assert len(m.blocks) == 100 and isinstance(m.blocks, nn.ModuleList)
    assert all(type(b) is DeepBlock for b in m.blocks)
    assert {tuple(p.shape) for b in m.blocks for p in b.parameters()} == {(256, 256), (256,)}
    x = torch.randn(16, 1000)
    h = m.stem(x)
    start = h.std()
    for block in m.blocks:
        h = block(h)
    # The 1/sqrt(depth) residual scale keeps 100 blocks from blowing activations up.
    assert torch.isfinite(h).all() and h.std() < 10 * start
    assert m(x).shape == (16, 10)
    plain = DeepMLP(depth=3, width=8, in_dim=5, num_classes=3, residual=False)
    assert plain(torch.randn(4, 5)).shape == (4, 3) and not plain.blocks[0].residual


@pytest.mark.parametrize(
    "make",
    [
        lambda: MLPClassifier(dims=[8, 4, 2], lr=0.3, momentum=0.5),
        lambda: SeedMLP(activation="tanh"),
        lambda: DeepMLP(depth=3, width=8, in_dim=5, num_classes=3, optimizer="adamw"),
        lambda: tiny_gpt(dropout=0.1, bias=False),
    ],
    ids=["mlp", "seed_mlp", "deep_mlp", "gpt"],
)
def test_hparams_rebuild_the_same_model(make: Callable[[], L.LightningModule]) -> None:
    """``type(m)(**m.hparams)`` is what load_from_checkpoint does; presets must not leak `dims`."""
    m = make()
    clone = type(m)(**m.hparams)
    assert dict(clone.hparams) == dict(m.hparams)
    assert {k: v.shape for k, v in clone.state_dict().items()} == {k: v.shape for k, v in m.state_dict().items()}
    if isinstance(m, SeedMLP):
        assert "dims" not in m.hparams and m.hparams.activation == "tanh"


def test_hydra_instantiation_and_listconfig_dims() -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    m = instantiate(OmegaConf.create({"_target_": "lightning_parallel.models.MLPClassifier", "dims": [6, 5, 4]}))
    assert linear_widths(m.net) == [6, 5, 4]
    assert type(m.hparams.dims) is list  # plain list, not ListConfig, so checkpoints stay portable
    seed = instantiate({"_target_": "lightning_parallel.models.SeedMLP", "lr": 0.2})
    assert isinstance(seed, SeedMLP) and seed.lr == 0.2


def test_init_is_deterministic_from_the_global_seed() -> None:
    def params(seed: int) -> list[Tensor]:
        torch.manual_seed(seed)
        return [p.detach().clone() for p in tiny_gpt().parameters()]

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


# ----------------------------------------------------------------------------- GPT


def test_gpt_layout_names() -> None:
    m = tiny_gpt()
    names = {n for n, _ in m.named_parameters()}
    for expected in (
        "tok_emb.weight",
        "pos_emb.weight",
        "blocks.1.ln_1.weight",
        "blocks.1.attn.q.weight",
        "blocks.1.attn.k.bias",
        "blocks.1.attn.v.weight",
        "blocks.1.attn.proj.weight",
        "blocks.1.ln_2.bias",
        "blocks.1.mlp.fc.weight",
        "blocks.1.mlp.proj.weight",
        "ln_f.weight",
        "lm_head.weight",
    ):
        assert expected in names, expected
    assert isinstance(m.drop, nn.Dropout) and isinstance(m.blocks, nn.ModuleList)
    assert isinstance(m.blocks[0], Block) and isinstance(m.blocks[0].attn, CausalSelfAttention)
    assert isinstance(m.blocks[0].mlp, MLP) and m.blocks[0].mlp.fc.out_features == 4 * 32
    assert m.lm_head.bias is None and m.lm_head.weight is not m.tok_emb.weight  # untied
    assert m(torch.randint(0, 32, (3, 16))).shape == (3, 16, 32)
    assert m(torch.randint(0, 32, (3, 5))).shape == (3, 5, 32)  # shorter than block_size is fine


def reference_attention(attn: CausalSelfAttention, x: Tensor, n_head: int) -> Tensor:
    """Textbook masked softmax attention with ``n_head`` heads, written independently of SDPA."""
    B, T, C = x.shape
    hd = C // n_head
    q, k, v = (lin(x).reshape(B, T, n_head, hd).permute(0, 2, 1, 3) for lin in (attn.q, attn.k, attn.v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, C)
    return attn.proj(y)


@pytest.mark.parametrize("n_head", [1, 2, 4, 8])
def test_attention_uses_the_global_head_count(n_head: int) -> None:
    torch.manual_seed(n_head)
    attn = CausalSelfAttention(n_embd=32, n_head=n_head).eval()
    assert attn.n_head == n_head
    x = torch.randn(2, 7, 32)
    out = attn(x)
    torch.testing.assert_close(out, reference_attention(attn, x, n_head), rtol=1e-5, atol=1e-5)
    other = 2 if n_head == 1 else 1  # another head count gives another function
    assert not torch.allclose(out, reference_attention(attn, x, other), atol=1e-4)
    m = tiny_gpt(n_head=n_head)
    assert all(b.attn.n_head == n_head for b in m.blocks)
    assert m(torch.randint(0, 32, (2, 16))).shape == (2, 16, 32)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    m = tiny_gpt().eval()
    idx = torch.randint(0, 32, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 32
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


class CountingMLP(nn.Module):
    """A stand-in for an expert layer: proves GPT builds layer ``i`` through ``_make_mlp(i)``."""

    def __init__(self, n_embd: int, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.lin = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


class HookedGPT(GPT):
    def _make_mlp(self, layer_idx: int) -> nn.Module:
        return CountingMLP(self.n_embd, layer_idx)

    def compute_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return super().compute_loss(logits, targets) + 100.0  # an "auxiliary" term


def test_subclass_hooks_replace_the_mlp_and_extend_the_loss() -> None:
    m = HookedGPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16)
    assert [b.mlp.layer_idx for b in m.blocks] == [0, 1, 2]
    assert "blocks.2.mlp.lin.weight" in dict(m.named_parameters())
    idx, tgt = torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer warns
        loss = m.training_step((idx, tgt), 0)
    torch.testing.assert_close(loss, F.cross_entropy(m(idx).view(-1, 32), tgt.view(-1)) + 100.0)


@pytest.mark.parametrize("make", [lambda: MLPClassifier(dims=[6, 5, 3]), lambda: tiny_gpt()], ids=["mlp", "gpt"])
def test_each_step_calls_forward_exactly_once(make: Callable[[], L.LightningModule]) -> None:
    m = make()
    if isinstance(m, GPT):
        batch = (torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)))
    else:
        batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    calls: list[Tensor] = []
    original = m.forward

    def counting_forward(x: Tensor) -> Tensor:
        calls.append(x)
        return original(x)

    m.forward = counting_forward  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (m.training_step, m.validation_step, m.test_step):
            calls.clear()
            loss = step(batch, 0)
            assert len(calls) == 1 and calls[0] is batch[0]
            assert loss.ndim == 0 and torch.isfinite(loss)
    calls.clear()
    logits = m.predict_step(batch, 0)
    assert len(calls) == 1 and logits.shape[:-1] == batch[1].shape
    torch.testing.assert_close(m.predict_step(batch[0], 0), logits)


def test_configure_optimizers() -> None:
    sgd = MLPClassifier(dims=[4, 2], lr=0.3, momentum=0.9, weight_decay=0.01).configure_optimizers()
    assert type(sgd) is torch.optim.SGD
    assert sgd.defaults["lr"] == 0.3 and sgd.defaults["momentum"] == 0.9 and sgd.defaults["weight_decay"] == 0.01
    m = tiny_gpt(optimizer="AdamW", lr=1e-3, eps=1e-3)
    adamw = m.configure_optimizers()
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["eps"] == 1e-3
    assert sum(len(g["params"]) for g in adamw.param_groups) == len(list(m.parameters()))


@pytest.mark.parametrize(
    "make, kind, match",
    [
        (lambda: MLPClassifier(dims=[10]), ValueError, r"`dims`=\[10\].*at least 2"),
        (lambda: MLPClassifier(dims=[10, 0, 2]), ValueError, r"`dims\[1\]`=0.*> 0"),
        (lambda: MLPClassifier(dims="64,10"), TypeError, r"`dims`='64,10'.*list of ints"),
        (lambda: MLPClassifier(dims=[4, 2], activation="swish"), ValueError, r"`activation`='swish'.*relu"),
        (lambda: SeedMLP(optimizer="adam"), ValueError, r"`optimizer`='adam'.*'sgd', 'adamw'"),
        (lambda: SeedMLP(lr=0.0), ValueError, r"`lr`=0.0.*> 0"),
        (lambda: SeedMLP(momentum=1.5), ValueError, r"`momentum`=1.5"),
        (lambda: DeepMLP(depth=0), ValueError, r"`depth`=0"),
        (lambda: DeepMLP(width=2.5), TypeError, r"`width`=2.5.*int"),
        (lambda: tiny_gpt(n_embd=30, n_head=4), ValueError, r"`n_embd`=30.*divisible by n_head=4"),
        (lambda: tiny_gpt(dropout=1.0), ValueError, r"`dropout`=1.0.*\[0, 1\)"),
        (lambda: tiny_gpt(vocab_size=0), ValueError, r"`num_classes`=0"),
        (lambda: tiny_gpt()(torch.zeros(1, 17, dtype=torch.long)), ValueError, r"block_size=16"),
        (lambda: DigitsData(batch_size=0), ValueError, r"`batch_size`=0"),
        (lambda: DigitsData(seed=-1), ValueError, r"`seed`=-1"),
        (lambda: DigitsData(shuffle="yes"), TypeError, r"`shuffle`='yes'"),
        (lambda: DigitsData(val_fraction=0.6, test_fraction=0.5), ValueError, r"val_fraction \+ test_fraction"),
        (lambda: DigitsData(batch_size=5000).train_dataloader(), ValueError, r"`batch_size`=5000.*training"),
        (lambda: SyntheticTokensData(vocab_size=8, max_stride=8), ValueError, r"`max_stride`=8.*vocab_size=8"),
        (lambda: SyntheticTokensData(noise=-0.1), ValueError, r"`noise`=-0.1"),
        (lambda: SyntheticClassificationData(num_classes=1), ValueError, r"`num_classes`=1"),
        (lambda: CharCorpusData(max_chars=100, block_size=64), ValueError, r"`max_chars`=100.*raise max_chars"),
    ],
)
def test_bad_input_raises_typed_errors_naming_field_value_and_fix(
    make: Callable[[], object], kind: type[Exception], match: str
) -> None:
    with pytest.raises(kind, match=match) as info:
        make()
    assert "HINT:" in str(info.value)


# ----------------------------------------------------------------------------- data

DATA_FACTORIES: dict[str, Callable[[int], SplitDataModule]] = {
    "synthetic_cls": lambda seed: SyntheticClassificationData(in_dim=16, num_samples=256, seed=seed),
    "digits": lambda seed: DigitsData(seed=seed),
    "synthetic_tokens": lambda seed: SyntheticTokensData(block_size=16, num_samples=128, seed=seed),
    "char_corpus": lambda seed: CharCorpusData(block_size=32, max_chars=20_000, seed=seed),
}


@pytest.mark.parametrize("name", list(DATA_FACTORIES))
def test_data_is_deterministic_for_a_seed_and_differs_across_seeds(name: str) -> None:
    make = DATA_FACTORIES[name]
    a, b, c = make(0), make(0), make(1)
    for split in ("train", "val", "test"):
        xa, ya = materialize(getattr(a.splits, split))
        xb, yb = materialize(getattr(b.splits, split))
        assert len(xa) > 0 and torch.equal(xa, xb) and torch.equal(ya, yb), split
    assert not torch.equal(materialize(a.splits.train)[0], materialize(c.splits.train)[0])
    if name == "char_corpus":  # evaluation windows are fixed so that scores compare across seeds
        assert torch.equal(materialize(a.splits.val)[0], materialize(c.splits.val)[0])
    # Train order: seeded shuffle reproducible, shuffle=False follows the dataset, batches full.
    first = [next(iter(m.train_dataloader()))[0] for m in (a, b, c)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    a.shuffle = False
    batches = list(a.train_dataloader())
    assert torch.equal(batches[0][0], materialize(a.splits.train)[0][: a.batch_size])
    assert all(len(x) == a.batch_size for x, _ in batches)  # drop_last
    n_val = len(a.splits.val)
    assert sum(len(x) for x, _ in a.val_dataloader()) == n_val  # evaluation keeps every sample
    a.eval_drop_last = True
    assert sum(len(x) for x, _ in a.val_dataloader()) == n_val - n_val % a.batch_size
    assert len(list(a.predict_dataloader())) == len(list(a.test_dataloader()))


def test_classification_data_shapes_and_labels() -> None:
    data = SyntheticClassificationData(in_dim=16, num_classes=5, num_samples=512)
    x, y = data.splits.train.tensors
    assert x.shape == (384, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(data.splits.val) == len(data.splits.test) == 64
    counts = torch.bincount(y, minlength=5)
    assert (counts > len(y) / 5 / 3).all(), counts  # centred teacher logits keep classes balanced

    digits = DigitsData()
    xd, yd = digits.splits.train.tensors
    assert digits.in_dim == xd.shape[1] == 64 and set(yd.tolist()) == set(range(10))
    assert sum(len(getattr(digits.splits, s)) for s in ("train", "val", "test")) == 1797
    assert xd.mean(0).abs().max() < 1e-5  # standardised with training statistics


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        DigitsData().setup()


def test_token_data_windows_shift_by_one_and_fit_the_vocabulary() -> None:
    tokens = SyntheticTokensData(vocab_size=64, block_size=16, num_samples=256, noise=0.1)
    x, y = tokens.splits.train.tensors
    assert x.shape == y.shape == (192, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(max(x.max(), y.max())) < 64
    # Learnable: mostly the next step of the progression the previous two tokens define.
    follows = (y[:, 1:] - x[:, 1:]) % 64 == (x[:, 1:] - x[:, :-1]) % 64
    assert follows.float().mean() > 0.6

    chars = CharCorpusData(block_size=32, max_chars=20_000)
    assert chars.vocab_size == 128
    xc, yc = materialize(chars.splits.train)
    assert xc.shape[1] == 32 and torch.equal(xc[:, 1:], yc[:, :-1]) and int(xc.max()) < 128
    assert "def " in decode(chars.splits.val.stream)  # it is Python source


def test_char_encoding() -> None:
    assert decode(encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    codes = encode("naïve – ok")
    assert len(codes) == 10 and codes.dtype == torch.uint8 and int(codes.max()) < 128
    assert codes[2] == UNKNOWN_CODE and codes[6] == UNKNOWN_CODE and decode(codes[7:]) == " ok"
    assert len(encode("")) == 0 and FILE_SEPARATOR < 128


# ----------------------------------------------------------------------------- learning


def fit_and_validate(
    model: L.LightningModule, data: L.LightningDataModule, steps: int, **kw: Any
) -> tuple[dict[str, float], dict[str, float], L.Trainer]:
    """Validate, fit for ``steps``, validate again; also checks that training logged its metrics."""
    L.seed_everything(0, verbose=False)
    t = trainer(steps, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "few workers" and similar Lightning advice
        before = t.validate(model, datamodule=data, verbose=False)[0]
        t.fit(model, datamodule=data)
        assert {"train_loss", "train_acc"} <= set(t.callback_metrics)
        after = t.validate(model, datamodule=data, verbose=False)[0]
    return before, after, t


def test_mlp_learns_digits_and_logs_every_stage(tmp_path: Any) -> None:
    L.seed_everything(0, verbose=False)
    model = MLPClassifier(dims=[64, 64, 10], lr=0.1, momentum=0.9)
    data = DigitsData(batch_size=32)
    before, after, t = fit_and_validate(model, data, steps=40)
    assert before["val_loss"] > 2.0 and before["val_acc"] < 0.3
    assert after["val_loss"] < 0.5 and after["val_acc"] > 0.85, after
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tested = t.test(model, datamodule=data, verbose=False)[0]
        preds = t.predict(model, datamodule=data)
    assert set(tested) == {"test_loss", "test_acc"} and tested["test_acc"] > 0.8
    assert preds[0].shape == (32, 10) and sum(len(p) for p in preds) == len(data.splits.test)
    t.save_checkpoint(tmp_path / "mlp.ckpt")
    restored = MLPClassifier.load_from_checkpoint(tmp_path / "mlp.ckpt")
    assert restored.hparams == model.hparams
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))


def test_gpt_learns_python_source_beyond_character_frequencies() -> None:
    data = CharCorpusData(block_size=32, batch_size=16, max_chars=50_000)
    stream = data.splits.train.stream.long()
    freq = torch.bincount(stream, minlength=128).float() / len(stream)
    _, val_targets = materialize(data.splits.val)
    unigram_loss = -freq[val_targets.reshape(-1)].clamp_min(1e-9).log().mean().item()
    L.seed_everything(0, verbose=False)
    model = GPT(block_size=32, n_layer=2, n_head=4, n_embd=64, lr=3e-3, optimizer="adamw")
    before, after, _ = fit_and_validate(model, data, steps=100, limit_val_batches=8)
    assert before["val_loss"] == pytest.approx(math.log(128), abs=0.1)
    # Below what character frequencies alone give: the model uses its context.
    assert after["val_loss"] < before["val_loss"] - 1.2 and after["val_loss"] < unigram_loss - 0.2, (
        after,
        unigram_loss,
    )


def test_synthetic_sets_are_learnable() -> None:
    L.seed_everything(0, verbose=False)
    deep = DeepMLP(depth=20, width=64, in_dim=32, num_classes=4, lr=0.1, momentum=0.9)
    cls_data = SyntheticClassificationData(in_dim=32, num_classes=4, num_samples=1024)
    before, after, _ = fit_and_validate(deep, cls_data, steps=60)
    assert after["val_acc"] > 0.6 and after["val_loss"] < before["val_loss"] - 0.3, (before, after)

    L.seed_everything(0, verbose=False)
    gpt = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, lr=3e-3, optimizer="adamw")
    tok_data = SyntheticTokensData(vocab_size=32, block_size=16, num_samples=1024, batch_size=16, max_stride=3)
    before, after, _ = fit_and_validate(gpt, tok_data, steps=80)
    assert after["val_loss"] < before["val_loss"] - 1.0 and after["val_acc"] > 0.3, (before, after)
