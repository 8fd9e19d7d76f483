"""EpochSampler: the order of the samples is a function of (seed, epoch) alone, kept local to a few shards at a time
when the data is sharded. The order is part of what a checkpoint means (a resumed run must see the samples the
interrupted one would have), so the exact orders of a few seeds are pinned: a change here must be deliberate."""

import numpy as np
import pytest
import torch

from mae.data.samplers import SHUFFLE_WINDOW, EpochSampler


def order(sampler: EpochSampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    pairs = list(sampler)
    assert {e for e, _ in pairs} <= {epoch}  # every index is tagged with the epoch it was drawn for
    return [i for _, i in pairs]


def test_without_shuffle_the_order_is_the_data_order():
    s = EpochSampler(7, seed=3, shuffle=False)
    assert len(s) == 7 and order(s, 4) == list(range(7)) and list(s) == [(4, i) for i in range(7)]


def test_the_orders_of_a_few_seeds_and_epochs_are_pinned():
    assert order(EpochSampler(12, seed=3), 2) == [6, 11, 9, 5, 4, 0, 3, 10, 8, 7, 1, 2]
    assert order(EpochSampler(12, seed=4), 0) == [0, 9, 1, 5, 11, 6, 4, 8, 3, 7, 10, 2]
    sharded = EpochSampler(12, seed=3, shard_ends=[2, 5, 6, 9, 12])
    assert order(sharded, 1) == [4, 1, 10, 8, 0, 2, 9, 5, 6, 3, 7, 11]


@pytest.mark.parametrize("shard_ends", [None, np.cumsum([5, 7, 3, 9] * 5)])
def test_the_order_is_a_permutation_that_depends_on_seed_and_epoch_only(shard_ends):
    n = 120 if shard_ends is None else int(shard_ends[-1])
    torch.manual_seed(0)
    np.random.seed(0)
    a = order(EpochSampler(n, seed=3, shard_ends=shard_ends), 1)
    torch.manual_seed(1)
    np.random.seed(1)
    assert order(EpochSampler(n, seed=3, shard_ends=shard_ends), 1) == a  # the global RNGs play no part
    assert sorted(a) == list(range(n)) and a != list(range(n))
    assert order(EpochSampler(n, seed=3, shard_ends=shard_ends), 2) != a
    assert order(EpochSampler(n, seed=4, shard_ends=shard_ends), 1) != a
    assert order(EpochSampler(n, seed=0, shard_ends=shard_ends), 1) != order(
        EpochSampler(n, seed=0, shard_ends=shard_ends), 0
    )  # seed 0 too: the epoch is not multiplied away


def windows(idx: list[int], ends: np.ndarray) -> list[set[int]]:
    """Split an order into its runs of whole shards: a run closes once it holds every sample of its shards."""
    sizes = np.diff(np.concatenate([[0], ends]))
    runs, shards, seen = [], set(), 0
    for shard in np.searchsorted(ends, idx, side="right").tolist():
        shards.add(shard)
        seen += 1
        if seen == sum(sizes[list(shards)]):
            runs.append(shards)
            shards, seen = set(), 0
    assert not shards
    return runs


@pytest.mark.parametrize("seed", [0, 3])
def test_sharded_orders_read_shard_by_shard_window_by_window(seed):
    sizes = [5, 7, 3, 9] * 5  # 20 shards of unequal sizes
    ends = np.cumsum(sizes)
    s = EpochSampler(int(ends[-1]), seed=seed, shard_ends=list(ends))
    for epoch in range(3):
        idx = order(s, epoch)
        runs = windows(idx, ends)
        # Runs of whole shards that add up to windows of 8 shards (SHUFFLE_WINDOW), the last one of 4:
        chunks, size = [], 0
        for run in runs:
            size += len(run)
            if size >= 8:
                chunks.append(size)
                size = 0
        assert SHUFFLE_WINDOW == 8 and chunks == [8, 8] and size == 4
        # Within a window the samples are mixed: the shard changes far more often than once per shard.
        shard_of = np.searchsorted(ends, idx, side="right")
        assert int((shard_of[1:] != shard_of[:-1]).sum()) > 2 * 20
    # and the shards are shuffled: the first window is not always the first 8 shards
    firsts = set()
    for epoch in range(4):
        shard_of = np.searchsorted(ends, order(s, epoch), side="right")
        firsts.add(frozenset(shard_of[:24].tolist()))
    assert len(firsts) > 1


def test_a_new_sampler_draws_epoch_0():
    fresh, reset = EpochSampler(9, seed=2), EpochSampler(9, seed=2)
    reset.set_epoch(5)
    reset.set_epoch(0)
    assert list(fresh) == list(reset) and {e for e, _ in fresh} == {0}
