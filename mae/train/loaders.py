"""Loaders: the DataLoader every stage uses, the training loader behind one contract, and evaluation loaders.

`fit` talks to a training loader through `TrainingLoader`: `len` (batches per epoch on this process),
`set_epoch`, `skip_first_batches` (after a resume), `state_dict` / `load_state_dict` (a stream's position;
nothing for map-style data). `MapLoader` wraps Accelerate's prepared loader and our epoch sampler;
`StreamLoader` reads this process's part of a stream.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState

from mae.data.samplers import EpochSampler
from mae.data.streaming import StreamSamples, StreamSource
from mae.errors import ConfigError, DataError
from mae.train.checkpoint import load_process_state


def make_loader(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    collate_fn: Any,
    num_workers: int,
    sampler: Any = None,
    drop_last: bool = True,
    persistent: bool = True,
) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        # the epoch travels with each index, not the dataset (a stream's workers must start afresh instead)
        persistent_workers=persistent and num_workers > 0,
        worker_init_fn=_init_worker,
        generator=_own_generator(),
    )


def _own_generator() -> torch.Generator:
    """A generator of the loader's own for the seed every pass draws for its workers. Without one, each pass
    draws from torch's global generator, which also drives dropout and drop path: a resumed run, whose pass over
    the interrupted epoch starts after the checkpoint's RNG state is restored, would draw once more than an
    uninterrupted one and train on different random numbers. Seeded from the global generator, so the worker
    seeds still follow `--seed`; sample randomness comes from (seed, epoch, index) whatever the worker's seed."""
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(2**62, ())))
    return generator


def _init_worker(worker_id: int) -> None:
    """Workers leave SIGTERM/SIGINT to the training process: a scheduler that signals the whole process
    group must get a checkpoint and a clean exit, not a crash from a dead worker. And they stay quiet
    when the training process is gone (`_quiet_sharer_errors`)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _quiet_sharer_errors


def _quiet_sharer_errors(exc_type, exc, tb) -> None:
    """A worker's thread that hands tensors to the training process fails with a reset connection when that
    process has already stopped (after its own one-line error, e.g. another worker died): no news, and a
    traceback under the error line would read as a second failure. Anything else is printed as usual."""
    frames = traceback.extract_tb(tb)
    if frames and Path(frames[0].filename).name == "resource_sharer.py":
        return
    sys.__excepthook__(exc_type, exc, tb)


def check_batch_fits(n: int, cfg: Any, accelerator: Accelerator) -> None:
    if n < cfg.loop.batch_size * accelerator.num_processes:
        raise ConfigError(
            f"--loop.batch_size {cfg.loop.batch_size}: {n} images cannot fill one batch of "
            f"{cfg.loop.batch_size} x {accelerator.num_processes} processes; lower the batch size"
        )


def prepare_eval(accelerator: Accelerator, loader: Any) -> Any:
    """An evaluation loader, prepared (sharded over processes, gathered exactly by `features.predict`);
    a stream's (`EvalStream`) is split by process already and stays as it is."""
    return loader if getattr(loader, "streamed", False) else accelerator.prepare_data_loader(loader)


class EvalStream:
    """One ordered pass over this process's part of a stream, for evaluations (`features.predict` gathers
    the parts of all processes at the end); `streamed` marks it for them."""

    streamed = True

    def __init__(self, dataset: StreamSamples, *, batch_size: int, collate_fn: Callable, num_workers: int):
        self.dataset, self.collate = dataset, collate_fn
        self.loader = make_loader(
            dataset, batch_size=batch_size, collate_fn=self._collate, num_workers=num_workers, drop_last=False
        )

    def _collate(self, samples: list[dict]) -> dict:
        return self.collate([{k: v for k, v in s.items() if k != "stream"} for s in samples])

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.loader.batch_size)

    def __iter__(self):
        return iter(self.loader)


class StreamLoader:
    """The training loader over a stream, in the shape the loop expects of Accelerate's: `len` (batches per
    epoch per process), `set_epoch`, `skip_first_batches`, batches on the device; plus `state_dict` /
    `load_state_dict` (each worker's position), which the loop saves with every checkpoint, per process."""

    def __init__(self, dataset: StreamSamples, *, batch_size: int, collate_fn: Callable, num_workers: int, device):
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

    def epoch_batches(self, epoch: int, skip: int = 0) -> StreamLoader:
        """This process's batches of `epoch`. After a resume the positions restored by `restore` already skip
        the consumed examples; only the count of this epoch's batches starts at `skip`."""
        self.set_epoch(epoch)
        self._skip = skip
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

    def restore(self, checkpoint: Path, rank: int) -> None:
        """Continue from the positions this process saved in `checkpoint`."""
        self.load_state_dict(load_process_state(checkpoint, rank))

    def load_state_dict(self, state: dict) -> None:
        self.dataset.epoch = self._positions_epoch = int(state["epoch"])
        self.dataset.positions = {int(w): p for w, p in state["workers"].items()}
        self._next_worker = int(state["next_worker"])


class MapLoader:
    """Accelerate's prepared loader over an `EpochSampler` (map-style data: folders, datasets, shards), in the
    shape `fit` expects of every training loader."""

    def __init__(self, accelerator: Accelerator, loader: torch.utils.data.DataLoader, sampler: EpochSampler) -> None:
        self.accelerator, self.loader, self.sampler = accelerator, loader, sampler
        self.num_workers = loader.num_workers

    def __len__(self) -> int:
        return len(self.loader)

    def epoch_batches(self, epoch: int, skip: int = 0):
        """The batches of `epoch`, the first `skip` left out (after a resume)."""
        batches = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        # Accelerate's loader re-sets its sampler's epoch from its own counter on every pass; give both ours,
        # which is the truth after a resume.
        batches.set_epoch(epoch)
        self.sampler.set_epoch(epoch)
        return batches

    def state_dict(self) -> None:
        """Nothing of its own to save: the sampler's order follows from (seed, epoch)."""
        return None

    def restore(self, checkpoint: Path, rank: int) -> None:
        """Nothing to restore: `epoch_batches` skips what the checkpoint's step consumed."""


def training_loader(
    cfg: Any, dataset: torch.utils.data.Dataset, collate_fn: Callable, num_workers: int
) -> tuple[EpochSampler, torch.utils.data.DataLoader]:
    """The epoch sampler (local reads for a shard set: its `shard_ends`) and the training loader, before
    `prepare` (which shards its batches over processes)."""
    shard_ends = getattr(getattr(dataset, "source", None), "shard_ends", None)
    sampler = EpochSampler(len(dataset), cfg.seed, shard_ends=shard_ends)
    loader = make_loader(
        dataset, batch_size=cfg.loop.batch_size, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers
    )
    return sampler, loader


def prepare_training(
    cfg: Any,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: torch.utils.data.Dataset,
    collate_fn: Callable,
    num_workers: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, MapLoader | StreamLoader]:
    """`accelerator.prepare` the model and optimizer with the training loader (one call, as DeepSpeed needs
    the loader to size its batches); a stream's loader (each process reads its own part) is not prepared."""
    if isinstance(getattr(dataset, "source", None), StreamSource):
        samples = StreamSamples(
            dataset.source,
            dataset.prepare,
            seed=cfg.seed,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            in_chans=dataset.in_chans,
        )
        loader = StreamLoader(
            samples, batch_size=cfg.loop.batch_size, collate_fn=collate_fn, num_workers=num_workers,
            device=accelerator.device,
        )  # fmt: skip
        model, optimizer = accelerator.prepare(model, optimizer)
        return model, optimizer, loader
    check_batch_fits(len(dataset), cfg, accelerator)
    sampler, raw = training_loader(cfg, dataset, collate_fn, num_workers)
    model, optimizer, raw = accelerator.prepare(model, optimizer, raw)
    return model, optimizer, MapLoader(accelerator, raw, sampler)


def eval_loader(
    source: Any,
    make_dataset: Callable[..., torch.utils.data.Dataset],
    collate_fn: Callable,
    *,
    batch_size: int,
    num_workers: int,
    decode_side: int | None = None,
) -> torch.utils.data.DataLoader | EvalStream:
    """An ordered pass over `source` for evaluation or features: `make_dataset(source, decode_side=...)` makes
    its samples. Map-style data through a DataLoader (`prepare_eval` shards it over processes); a stream as this
    process's part of it, in order (`EvalStream`)."""
    if isinstance(source, StreamSource):
        state = PartialState()
        dataset = make_dataset(source)
        samples = StreamSamples(
            source, dataset.prepare, seed=0, rank=state.process_index, world=state.num_processes,
            in_chans=dataset.in_chans, shuffle=False,
        )  # fmt: skip
        return EvalStream(samples, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers)
    return make_loader(
        make_dataset(source, decode_side=decode_side),
        batch_size=batch_size,
        drop_last=False,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )
