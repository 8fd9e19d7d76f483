"""A sampler that yields (epoch, index), so each sample's randomness can depend on both."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class EpochSampler(torch.utils.data.Sampler):
    """A permutation of range(n) drawn from (seed, epoch), yielding `(epoch, index)` pairs.

    Call `set_epoch` before each epoch. The order depends on nothing else, so one process with
    batch B and P processes with batch B/P (Accelerate shards whole batches round-robin) see the
    same samples at every step.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = range(self.n)
        for i in order:
            yield (self.epoch, i)
