"""Which tokens of a sequence each context-parallel rank holds.

A causal mask makes later tokens cost more (token ``t`` attends to ``t + 1`` keys), so cutting
a sequence into ``cp`` contiguous pieces would give the last rank almost all the work. The
sequence is cut into ``2 * cp`` equal chunks instead and rank ``r`` takes chunk ``r`` and its
mirror ``2 * cp - 1 - r``: every rank then holds the same number of (query, key) pairs under a
causal mask (torch's ``_HeadTailLoadBalancer`` and Megatron-core balance the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ChunkLayout:
    """The head-tail chunks of a ``seq_len`` sequence over ``cp`` ranks, seen from ``rank``."""

    seq_len: int
    cp: int
    rank: int

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp - 1 - rank

    def positions(self, rank: int | None = None, device: torch.device | str = "cpu") -> Tensor:
        """Global token positions held by ``rank`` (default: this rank), in local order."""
        head, tail = self.chunk_ids(self.rank if rank is None else rank)
        c = self.chunk
        return torch.cat([torch.arange(head * c, (head + 1) * c, device=device),
                          torch.arange(tail * c, (tail + 1) * c, device=device)])

    def all_positions(self, device: torch.device | str = "cpu") -> Tensor:
        """``[cp, local_len]``: row ``r`` is rank ``r``'s positions (the order of an all-gather)."""
        return torch.stack([self.positions(r, device) for r in range(self.cp)])

    def split(self, t: Tensor, dim: int) -> Tensor:
        """This rank's part of a whole-sequence tensor (``t.size(dim) == seq_len``)."""
        head, tail = self.chunk_ids(self.rank)
        c = self.chunk
        return torch.cat([t.narrow(dim, head * c, c), t.narrow(dim, tail * c, c)], dim=dim)

    def restore(self, gathered: Tensor, dim: int) -> Tensor:
        """Global order from the rank-order concatenation of every rank's part (an all-gather)."""
        order = torch.argsort(self.all_positions(gathered.device).flatten())
        return gathered.index_select(dim, order)
