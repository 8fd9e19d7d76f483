"""Labeled images for probing, fine-tuning and k-NN, whatever their source kind: held-out splits and the
labeled sample. Labeled sources themselves come from `mae.data.open.open_source(path, labeled=True)`: an
image source with `labels` (int64 array) and `classes` (names, index = label).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch

from mae.data.base import BaseSource
from mae.data.transforms import DecodedImages, sample_seed


class Subset(BaseSource):
    """Some rows of a labeled source (a held-out split), with the same interface."""

    def __init__(self, source, indices: np.ndarray) -> None:
        self.source, self.indices = source, np.asarray(indices)
        self.labels, self.classes = source.labels[self.indices], source.classes

    def __len__(self) -> int:
        return len(self.indices)

    def load(self, i: int):
        return self.source.load(int(self.indices[i]))

    def load_array(self, i: int):
        return self.source.load_array(int(self.indices[i]))

    def name(self, i: int) -> str:
        return self.source.name(int(self.indices[i]))

    def raw(self, i: int) -> tuple[bytes, str] | None:
        return self.source.raw(int(self.indices[i]))

    def set_decode_size(self, side: int | None) -> None:
        self.source.set_decode_size(side)


def split(source, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, held-out) with `fraction` of the rows held out, chosen by `seed`."""
    order = np.random.default_rng(seed).permutation(len(source))
    n_val = max(1, round(fraction * len(source)))
    return Subset(source, np.sort(order[n_val:])), Subset(source, np.sort(order[:n_val]))


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Seed torch, `random` and NumPy (timm's augmentations use all three) for one sample. torch's state is
    restored after; `random` and NumPy are reseeded from a number drawn from their own stream before,
    so they go on as a function of their earlier state alone, whatever the sample's seed (saving and
    restoring their states took ~150 us, a third of a 28-px fine-tuning sample's time)."""
    torch_state = torch.random.get_rng_state()
    after = random.getrandbits(64), int(np.random.randint(2**32, dtype=np.uint64))
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that also queues CUDA seeding (slow)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.seed(after[0])
        np.random.seed(after[1])


class LabeledSamples(torch.utils.data.Dataset):
    """`dataset[(epoch, index)]` or `dataset[index]` -> {"image", "label", "index"}, or {"bad": (name, reason)}
    for a file that cannot be decoded. With a `seed`, the transform's randomness comes from (seed, epoch, index)."""

    def __init__(
        self,
        source,
        transform: Callable,
        seed: int | None = None,
        decode_side: int | None = None,
        in_chans: int = 3,
    ) -> None:
        self.source, self.transform, self.seed, self.in_chans = source, transform, seed, in_chans
        self.load = DecodedImages(source, in_chans)
        if decode_side:
            source.set_decode_size(decode_side)  # large JPEGs decode at a reduced scale (`BaseSource.set_decode_size`)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        img, bad = self.load(index)
        return bad if bad is not None else self.prepare(img, epoch, index, int(self.source.labels[index]))

    def prepare(self, img, epoch: int, index: int, label: int) -> dict:
        """A loaded image -> the sample, its randomness (with a seed) from (seed, epoch, index)."""
        if self.seed is None:
            x = self.transform(img)
        else:
            with seeded_rng(sample_seed(self.seed, epoch, index)):
                x = self.transform(img)
        return {"image": x, "label": label, "index": index}
