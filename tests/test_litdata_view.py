"""Datasets that shard themselves see the data-parallel view (``parallel/data/loader_view.py``).

litdata's ``StreamingDataset`` shards by the global rank it detects, so under dp2 x tp2 the two tp
peers of a dp rank would read different samples. Unit tests (no process group) read a real
``StreamingDataset`` written with litdata's own ``BinaryWriter`` as each of the four ranks would
(litdata told the global rank through its ``WORLD_SIZE``/``GLOBAL_RANK`` variables), in the loader's
process and in worker processes, and check a plain dataset that asks ``torch.distributed`` for its
rank. The multi-process test trains the package's GPT under dp2 x tp2 on a ``StreamingDataset``
built inside Lightning's ``train_dataloader`` hook (after the process group exists, as users do):
tp peers get identical batches, dp ranks disjoint ones, and the run matches one process trained
on the same global batches.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

litdata = pytest.importorskip("litdata")  # the test extra pins it

from lightning_parallel.parallel.data.loader_view import (  # noqa: E402
    DataParallelView,
    current_view,
    data_parallel_view,
    rank_view,
    set_litdata_views,
    with_data_parallel_view,
)

NUM_SAMPLES, BLOCK, VOCAB = 64, 16, 64
GPT_KWARGS = {"vocab_size": VOCAB, "block_size": BLOCK, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5}


def _tokens(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index``: a counting sequence starting at ``index`` (its first token names it)."""
    stream = (index + torch.arange(BLOCK + 1)) % VOCAB
    return stream[:-1].clone(), stream[1:].clone()


def write_stream(directory: Path) -> str:
    """``NUM_SAMPLES`` token pairs in litdata's chunked format, 8 per chunk."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(directory), chunk_size=8)
    for index in range(NUM_SAMPLES):
        writer.add_item(index, _tokens(index))
    writer.done()
    writer.merge()
    return str(directory)


def ordered_tokens(order: list[int]) -> TensorDataset:
    """The same samples as a map-style set, in ``order`` (the reference run's data)."""
    pairs = [_tokens(i) for i in order]
    return TensorDataset(torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]))


def _read_as_rank(data_dir: str, rank: int, world: int, num_workers: int, view: bool,
                  monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sample indices rank ``rank`` of a dp2 x tp2 layout reads (tp inside dp: dp rank = rank // 2)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what litdata detects on that rank
    monkeypatch.setenv("GLOBAL_RANK", str(rank))
    dataset = litdata.StreamingDataset(data_dir, drop_last=True)
    assert dataset.distributed_env.global_rank == rank  # the bug's premise: litdata sees the global rank
    loader = DataLoader(dataset, batch_size=4, num_workers=num_workers)
    if view:
        with_data_parallel_view(loader, DataParallelView(num_replicas=world // 2, rank=rank // 2))
    return sorted(int(i) for batch in loader for i in batch[0][:, 0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streaming_dataset_gets_the_data_parallel_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       num_workers: int) -> None:
    data_dir = write_stream(tmp_path / "stream")
    seen = [_read_as_rank(data_dir, rank, 4, num_workers, True, monkeypatch) for rank in range(4)]
    assert seen[0] == seen[1] and seen[2] == seen[3], "tp peers must read the same samples"
    assert not set(seen[0]) & set(seen[2]), "dp ranks must read disjoint samples"
    assert sorted(seen[0] + seen[2]) == list(range(NUM_SAMPLES)), "the dp ranks together read everything once"
    # Without the view the same loader gives the tp peers different samples: what the test guards.
    unviewed = [_read_as_rank(data_dir, rank, 4, num_workers, False, monkeypatch) for rank in (0, 1)]
    assert unviewed[0] != unviewed[1]


def test_streaming_dataloader_resumes_in_the_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``StreamingDataLoader.load_state_dict`` compares the saved world size with the one it detects;
    told the global one (4) against the saved dp one (2), it took litdata's elastic path and, with
    workers, resumed at other samples than the uninterrupted loader reads."""
    data_dir = write_stream(tmp_path / "stream")
    monkeypatch.setenv("WORLD_SIZE", "4")  # global rank 2 of dp2 x tp2: dp rank 1
    monkeypatch.setenv("GLOBAL_RANK", "2")

    def loader() -> Any:
        dataset = litdata.StreamingDataset(data_dir, drop_last=True)
        viewed = litdata.StreamingDataLoader(dataset, batch_size=4, num_workers=2)
        return with_data_parallel_view(viewed, DataParallelView(num_replicas=2, rank=1))

    whole = [batch[0][:, 0].tolist() for batch in loader()]
    interrupted = loader()
    first = next(iter(interrupted))[0][:, 0].tolist()
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert [first] + [batch[0][:, 0].tolist() for batch in resumed] == whole


def test_wrapped_streaming_datasets_get_the_view(tmp_path: Path) -> None:
    data_dir = write_stream(tmp_path / "stream")
    parts = [litdata.StreamingDataset(data_dir), litdata.StreamingDataset(data_dir)]
    combined = litdata.CombinedStreamingDataset(parts)
    assert set_litdata_views(combined, DataParallelView(4, 3)) == 2
    assert all((p.distributed_env.world_size, p.distributed_env.global_rank) == (4, 3) for p in parts)


class RankProbe(IterableDataset):
    """A dataset that asks ``torch.distributed`` and the environment for its rank while iterated,
    as datasets that shard themselves do; it yields what it was told."""

    def __iter__(self) -> Any:
        yield torch.tensor([dist.get_rank(), dist.get_world_size(), int(os.environ.get("RANK", "-1"))])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_asking_torch_distributed_gets_the_view(num_workers: int) -> None:
    original = dist.get_rank
    loader = with_data_parallel_view(DataLoader(RankProbe(), batch_size=None, num_workers=num_workers),
                                     DataParallelView(num_replicas=2, rank=1))
    told = [row.tolist() for row in loader]
    assert len(told) == max(1, num_workers)
    for rank, world, env_rank in told:
        assert (rank, world) == (1, 2)
        assert env_rank == (1 if num_workers else int(os.environ.get("RANK", "-1")))  # workers only
    assert dist.get_rank is original and current_view() is None  # nothing left behind in this process


def test_the_view_is_the_calling_threads_only() -> None:
    """Other threads (a background checkpoint writer) keep the real rank while a batch is read."""
    original, elsewhere = dist.get_rank, []
    with rank_view(DataParallelView(2, 1)):
        assert dist.get_rank() == 1 and dist.get_world_size() == 2
        thread = threading.Thread(target=lambda: elsewhere.append(current_view()))
        thread.start()
        thread.join()
    assert elsewhere == [None]
    assert dist.get_rank is original


def test_pure_data_parallel_needs_no_view() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(4)))
    assert data_parallel_view(1, 0) is None  # no process group: one rank, the view it already has
    assert with_data_parallel_view(loader, None) is loader and type(loader) is DataLoader
    assert data_parallel_view(2, 1, nodes=4) == DataParallelView(2, 1, num_nodes=2)  # nodes divide the replicas


# ---------------------------------------------------------------------------------- under a Trainer
class _StreamData:
    """A LightningDataModule that builds its StreamingDataset in ``train_dataloader``, once the
    process group exists: litdata then detects the global rank there, as in a user's run."""

    def __new__(cls, data_dir: str, batch_size: int, num_workers: int) -> Any:
        import lightning.pytorch as pl

        class StreamData(pl.LightningDataModule):
            def train_dataloader(self) -> Any:
                dataset = litdata.StreamingDataset(data_dir, drop_last=True)
                return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)

        return StreamData()


def fit_on_stream(data_dir: str, devices: int, tensor_parallel_size: int, batch_size: int, num_workers: int) -> dict[str, Any]:
    """One rank of the dp x tp run: the batches it trained on (by first token), losses, parameters."""
    import lightning.pytorch as pl

    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.models import GPT
    from lightning_parallel.testing.parity import _Recorder, full_parameters

    class Batches(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[list[int]] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.seen.append([int(i) for i in batch[0][:, 0]])

    pl.seed_everything(1234, verbose=False)
    model, batches, recorder = GPT(**GPT_KWARGS), Batches(), _Recorder()
    strategy = HybridParallelStrategy(tensor_parallel_size=tensor_parallel_size)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=5, gradient_clip_val=0.5, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[batches, recorder])
    trainer.fit(model, datamodule=_StreamData(data_dir, batch_size, num_workers))
    return {"seen": batches.seen, "losses": recorder.losses, "params": full_parameters(model),
            "dp": trainer.strategy.distributed_sampler_kwargs}


def test_dp2_tp2_streaming_dataset_matches_one_process(tmp_path: Path) -> None:
    from lightning_parallel.testing import run_distributed
    from lightning_parallel.testing.parity import FitSpec, run_fit
    from tests.test_data_parallel import assert_parity

    data_dir = write_stream(tmp_path / "stream")
    # No loader workers: the unit tests above read through them; one per rank doubled this test's time (12 s -> 25 s).
    ranks = run_distributed(fit_on_stream, 4, data_dir, 4, 2, 4, 0, init_backend=None, timeout=300)
    assert [r["dp"] for r in ranks] == [{"num_replicas": 2, "rank": r // 2} for r in range(4)]
    assert len(ranks[0]["seen"]) == 5
    assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[2]["seen"] == ranks[3]["seen"], "tp peers: same batches"
    dp0, dp1 = ([i for batch in ranks[r]["seen"] for i in batch] for r in (0, 2))
    assert len(set(dp0 + dp1)) == len(dp0 + dp1) == 40, "dp ranks: disjoint samples"
    # One process, global batch 8 = both dp ranks' batches of each step, in that order.
    order = [i for a, b in zip(ranks[0]["seen"], ranks[2]["seen"]) for i in a + b]
    reference = run_fit(FitSpec(model="lightning_parallel.models:GPT", model_kwargs=GPT_KWARGS,
                                data="tests.test_litdata_view:ordered_tokens", data_kwargs={"order": order},
                                global_batch=8, max_steps=5, trainer_kwargs={"gradient_clip_val": 0.5}))
    assert max(reference["grad_norms"]) > 0.5  # clipping is active
    for rank in ranks:
        assert_parity(rank, reference, "dp2 x tp2 on a StreamingDataset", per_tensor=True, metrics=False)
