"""Streaming `datasets` sources: `--data.path hf:NAME[:split] --data.streaming true`.

The dataset is read as a `datasets.IterableDataset`, never downloaded whole: each process reads its part
(`datasets.distributed.split_dataset_by_node`: whole shards when their count divides by the processes,
else every P-th example), its DataLoader workers split that part's shards between them, and a shuffle
buffer (seeded, re-seeded each epoch through `set_epoch`) mixes the examples.

What is guaranteed (and tested):
- an epoch is `len // processes // batch` steps per process (from the split's size on the dataset card, or
  counted once at start when the card does not say), so the progress bar and the lr schedule are exact;
  a process whose part ends early (unequal shards) starts it again to keep in step with the others;
- each example's crop, flip and mask are drawn from (seed, epoch, its position in the process's part);
- checkpoints hold how many examples each worker of each process has consumed this epoch; a resumed run
  (same processes and workers) replays the epoch's seeded order up to there without decoding what it
  skips (images are decoded here, not by `datasets`), so it continues exactly where the run stopped,
  shuffle buffers included, and ends bit-identical on CPU. Replaying does re-read the skipped examples'
  bytes. (The dataset's own `state_dict` was the first choice; in `datasets` 5.2 it fails to load inside
  DataLoader workers, and it drops the shuffle buffers' contents.)
What is not: unlike folders and shards, results depend on the number of processes and workers. For that
guarantee, and for random access, write the dataset as shards once (`mae shard hf:NAME --output DIR`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mae.data.base import BaseSource
from mae.data.hf import find_image_column, find_label_column, is_text, parse_hf_path, value_array, value_rgb
from mae.data.images import DECODE_ERRORS, check_channels
from mae.errors import DataError

SHUFFLE_BUFFER = 1000


def not_streamable(path: object) -> DataError:
    """The one-line error for `--data.streaming true` with a path that is not `hf:NAME[:split]`."""
    return DataError(f"--data.streaming true: streams hf:NAME[:split] only, not {path}; drop --data.streaming")


class StreamSource:
    """`hf:NAME[:split]` as a stream: `dataset` (an IterableDataset), `column`, `label_column`, `classes`,
    `len()` (the split's size), and `first_examples(n)`, a random-access source over its first n examples
    (previews, statistics). Labeled (`labeled=True`), the label column must be a ClassLabel."""

    shard_ends = None  # not a map-style source: `StreamSamples` reads it in order

    def __init__(
        self,
        path: str,
        *,
        labeled: bool = False,
        image_column: str | None = None,
        label_column: str | None = None,
        option: str = "--data.path",
    ) -> None:
        import datasets

        if not isinstance(path, str) or not path.startswith("hf:"):
            raise not_streamable(path)
        name, split = parse_hf_path(path)
        try:
            ds = datasets.load_dataset(name, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - hub and builder errors vary; the message is what matters
            raise DataError(f"{option} {path}: could not stream the dataset ({type(e).__name__}: {e})") from None
        self.label = path
        features = ds.features or ds._resolve_features().features
        self.column = column = find_image_column(features, image_column, path)
        self.label_column, self.classes = None, None
        if labeled:
            self.label_column = find_label_column(features, label_column, path)
            feature = features[self.label_column]
            if not isinstance(feature, datasets.ClassLabel):
                raise DataError(
                    f"{path}: the label column '{self.label_column}' is not a ClassLabel, so the classes are unknown "
                    "before the stream is read; give it a ClassLabel feature, or drop --data.streaming"
                )
            self.classes = list(feature.names)
        keep = [column] + ([self.label_column] if self.label_column else [])
        self.dataset = ds.select_columns(keep)
        if isinstance(features[column], datasets.Image) or is_text(features[column]):
            # decoded here (paths opened here), so replayed examples cost no decoding
            self.dataset = self.dataset.cast_column(column, datasets.Image(decode=False))
        self.length = self._size(ds, split)
        self._first: list[dict] = []

    def _size(self, ds, split: str) -> int:
        splits = getattr(ds.info, "splits", None) or {}
        if split in splits and splits[split].num_examples:
            return int(splits[split].num_examples)
        # The card does not say: count once, without decoding a single image.
        from datasets import Image as ImageFeature

        return sum(1 for _ in ds.select_columns([self.column]).cast_column(self.column, ImageFeature(decode=False)))

    def __len__(self) -> int:
        return self.length

    def set_decode_size(self, side: int | None) -> None:
        """Streamed images decode whole (as `BaseSource` does where it cannot scale)."""

    def decode(self, value: Any, in_chans: int | None, name: str):
        """An example's image as `load_image` gives it: PIL RGB for 3 channels, else a float tensor [C, H, W]
        with `in_chans` channels (None: as stored)."""
        if in_chans == 3:
            return value_rgb(value)
        a = value_array(value, name)
        if in_chans is not None:
            check_channels(a, in_chans, name)
        return torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)

    def first_examples(self, n: int) -> FirstExamples:
        """The stream's first `n` examples as a random-access source (read once, kept)."""
        if len(self._first) < n:
            self._first = [ex for _, ex in zip(range(n), self.dataset, strict=False)]
        return FirstExamples(self, self._first[:n])


class FirstExamples(BaseSource):
    """The first examples of a stream as a random-access source (`len`, `load`, `load_array`, `name`; with
    `labels` and `classes` when the stream is labeled)."""

    def __init__(self, stream: StreamSource, examples: list[dict]) -> None:
        self.stream, self.examples = stream, examples
        if stream.classes is not None:
            self.classes = stream.classes
            self.labels = np.asarray([ex[stream.label_column] for ex in examples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.examples)

    def name(self, i: int) -> str:
        return f"{self.stream.label}[{i}]"

    def load(self, i: int):
        return self.stream.decode(self.examples[i][self.stream.column], 3, self.name(i))

    def load_array(self, i: int) -> np.ndarray:
        return self.stream.decode(self.examples[i][self.stream.column], None, self.name(i)).permute(1, 2, 0).numpy()


class StreamSamples(torch.utils.data.IterableDataset):
    """This process's part of a stream, each example made a sample by `prepare(image, epoch, index[, label])`
    (the map-style dataset's own per-sample step), tagged with (worker, position) for checkpoints."""

    def __init__(
        self,
        source: StreamSource,
        prepare: Callable[..., dict],
        *,
        seed: int,
        rank: int,
        world: int,
        in_chans: int,
        shuffle: bool = True,
    ) -> None:
        self.source, self.prepare, self.seed = source, prepare, seed
        self.rank, self.world, self.in_chans, self.shuffle = rank, world, in_chans, shuffle
        self.epoch = 0
        self.positions: dict[int, int] = {}  # worker -> examples it has consumed this epoch

    def __len__(self) -> int:
        return len(self.source) // self.world

    def __iter__(self):
        from datasets.distributed import split_dataset_by_node

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ds = split_dataset_by_node(self.source.dataset, rank=self.rank, world_size=self.world)
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed, buffer_size=SHUFFLE_BUFFER)
        ds.set_epoch(self.epoch)
        skip = self.positions.get(worker, 0)
        count = 0
        s = self.source
        for example in ds:
            if count < skip:  # replaying the seeded order up to where the checkpoint was (bytes only)
                count += 1
                continue
            index = (count * workers + worker) * self.world + self.rank  # unique within the epoch
            count += 1
            name = f"{s.label}[rank {self.rank}, worker {worker}, #{count}]"
            try:
                img = s.decode(example[s.column], self.in_chans, name)
            except DECODE_ERRORS as e:
                out = {"bad": (name, f"{type(e).__name__}: {e}".splitlines()[0][:200])}
            else:
                extra = (int(example[s.label_column]),) if s.label_column else ()
                out = self.prepare(img, self.epoch, index, *extra)
            out["stream"] = (worker, count)
            yield out
