"""A sampler that yields (epoch, index), so each sample's randomness can depend on both."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

SHUFFLE_WINDOW = 8  # shards whose samples are shuffled together: each worker reads a few shards at a time


class EpochSampler(torch.utils.data.Sampler):
    """A permutation of range(n) drawn from (seed, epoch), yielding `(epoch, index)` pairs.

    Call `set_epoch` before each epoch. The order depends on nothing else, so one process with
    batch B and P processes with batch B/P (Accelerate shards whole batches round-robin) see the
    same samples at every step.

    With `shard_ends` (the cumulative sample counts of a shard set) the permutation keeps reads local:
    the shards are shuffled, then the samples within each run of `SHUFFLE_WINDOW` shards.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True, shard_ends: np.ndarray | None = None) -> None:
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.shard_ends = None if shard_ends is None else np.asarray(shard_ends)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if not self.shuffle:
            order = range(self.n)
        elif self.shard_ends is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = self._shard_local_order()
        for i in order:
            yield (self.epoch, i)

    def _shard_local_order(self) -> list[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        ends = self.shard_ends
        starts = np.concatenate([[0], ends[:-1]])
        shards = rng.permutation(len(ends))
        order = []
        for w in range(0, len(shards), SHUFFLE_WINDOW):
            window = np.concatenate([np.arange(starts[k], ends[k]) for k in shards[w : w + SHUFFLE_WINDOW]])
            order.append(rng.permutation(window))
        return np.concatenate(order).tolist()
