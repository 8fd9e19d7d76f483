"""Loaders over streams (`mae.data.streaming`): the training loader and the evaluation pass.

They take the place of Accelerate's prepared loaders for a stream, which each process has already
split by itself; the loop and `features.predict` tell them apart by type (`StreamLoader`) or by the
`streamed` flag (`EvalStream`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mae.data.streaming import StreamSamples
from mae.errors import DataError


class EvalStream:
    """One ordered pass over this process's part of a stream, for evaluations (`features.predict` gathers
    the parts of all processes at the end); `streamed` marks it for them."""

    streamed = True

    def __init__(self, dataset: StreamSamples, *, batch_size: int, collate_fn: Callable, num_workers: int):
        from mae.train.run import make_loader  # (run imports this module)

        self.dataset = dataset
        self.loader = make_loader(
            dataset, batch_size=batch_size, collate_fn=self._collate, num_workers=num_workers, drop_last=False
        )

    @staticmethod
    def _collate(samples: list[dict]) -> dict:
        from mae.data.transforms import collate_labeled

        return collate_labeled([{k: v for k, v in s.items() if k != "stream"} for s in samples])

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.loader.batch_size)

    def __iter__(self):
        return iter(self.loader)


class StreamLoader:
    """The training loader over a stream, in the shape the loop expects of Accelerate's: `len` (batches per
    epoch per process), `set_epoch`, `skip_first_batches`, batches on the device; plus `state_dict` /
    `load_state_dict` (each worker's position), which the loop saves with every checkpoint, per process."""

    def __init__(self, dataset: StreamSamples, *, batch_size: int, collate_fn: Callable, num_workers: int, device):
        from mae.train.run import make_loader  # (run imports this module)

        self.dataset, self.device, self.collate = dataset, device, collate_fn
        self.batches = len(dataset) // batch_size
        if self.batches < 1:
            raise DataError(
                f"--loop.batch_size {batch_size}: the stream's {len(dataset.source)} examples over "
                f"{dataset.world} process(es) cannot fill one batch; lower the batch size"
            )
        # Workers start afresh each epoch: they must see its seed and the positions to start from.
        self.loader = make_loader(
            dataset, batch_size=batch_size, collate_fn=self._collate, num_workers=num_workers, persistent=False
        )
        self.num_workers = num_workers
        self._skip = 0
        self._positions_epoch = 0
        self._next_worker = 0  # whose batch comes next (the DataLoader takes its workers in turn)

    def _collate(self, samples: list[dict]) -> dict:
        batch = self.collate([{k: v for k, v in s.items() if k != "stream"} for s in samples])
        batch["stream"] = samples[-1]["stream"]
        return batch

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._positions_epoch:  # a new epoch starts its parts from the beginning
            self.dataset.positions = {}
            self._positions_epoch = epoch
            self._next_worker = 0
        self.dataset.epoch = epoch

    def skip_first_batches(self, n: int) -> StreamLoader:
        """After a resume: the positions restored by `load_state_dict` already skip the consumed examples;
        only the count of this epoch's batches starts at n."""
        self._skip = n
        return self

    def __iter__(self):
        from accelerate.utils import send_to_device

        done, self._skip = self._skip, 0
        while done < self.batches:
            for batch, worker, position in self._in_worker_order():
                self.dataset.positions[worker] = position
                self._next_worker = (worker + 1) % max(1, self.num_workers)
                yield send_to_device(batch, self.device, non_blocking=True)
                done += 1
                if done == self.batches:
                    return
            self.dataset.positions = {}  # this process's part ran out early (unequal shards): start it again
            self._next_worker = 0

    def _in_worker_order(self):
        """The loader's batches in the workers' turn order of an uninterrupted epoch. A DataLoader takes its
        workers' batches in turn from worker 0; a resumed one must start from the worker whose turn it was,
        so batches that come early wait (at most one per worker while every worker has data)."""
        from collections import deque

        workers = max(1, self.num_workers)
        waiting: dict[int, deque] = {w: deque() for w in range(workers)}
        for batch in self.loader:
            worker, position = batch.pop("stream")
            waiting[worker].append((batch, position))
            while waiting[self._next_worker]:
                w = self._next_worker
                batch, position = waiting[w].popleft()
                yield batch, w, position
        for w in [(self._next_worker + k) % workers for k in range(workers)]:  # a worker ran out: the rest
            for batch, position in waiting[w]:
                yield batch, w, position

    def state_dict(self) -> dict:
        positions = {str(w): p for w, p in self.dataset.positions.items()}
        return {"epoch": self.dataset.epoch, "workers": positions, "next_worker": self._next_worker}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.epoch = self._positions_epoch = int(state["epoch"])
        self.dataset.positions = {int(w): p for w, p in state["workers"].items()}
        self._next_worker = int(state["next_worker"])
