"""A rank that dies of a signal or hangs is still told (``launcher.run_distributed``).

Such a rank reports nothing itself: its story is the end of its own stderr, which the launcher
keeps in a file per rank (C++ ``terminate`` messages and ``faulthandler``'s stacks included) and
relays as it comes. A rank killed for running out of time first dumps its threads' stacks."""

from __future__ import annotations

import os
import sys
import time

import pytest

from lightning_parallel.launcher import DistributedRunError, run_distributed


def _abort_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank one is about to abort", file=sys.stderr, flush=True)
        os.abort()
    return dist.get_rank()


def _rank_one_hangs_here() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_rank_that_dies_of_a_signal_is_told_by_its_stderr() -> None:
    with pytest.raises(DistributedRunError) as caught:
        run_distributed(_abort_on_rank_one, 2, timeout=60)
    story = str(caught.value)
    assert "--- rank 0: ok" in story
    assert "rank 1 failed:\nprocess exited with code -6 without a result" in story
    assert "rank 1's stderr" in story and "rank one is about to abort" in story
    assert "Fatal Python error: Aborted" in story and "_abort_on_rank_one" in story  # faulthandler's stack


def test_a_rank_killed_for_time_says_where_it_waited() -> None:
    with pytest.raises(DistributedRunError) as caught:
        run_distributed(_rank_one_hangs_here, 2, init_backend=None, timeout=15)
    story = str(caught.value)
    assert "--- rank 1: no result within 15s (killed)" in story
    assert "_rank_one_hangs_here" in story and "rank 1's stderr" in story
    assert "--- rank 0: ok" in story
