"""Streaming `datasets` (hf:NAME --data.streaming true): what mae/data/streaming.py says is guaranteed."""

import json
import shutil

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors.torch import load_file

from mae.cli import main
from mae.data.streaming import StreamSamples, StreamSource
from mae.train.loaders import StreamLoader

PRETRAIN = ["--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--loop.progress", "false",
            "--loop.mixed_precision", "no", "--loop.log_every", "1", "--optim.warmup_epochs", "0.5",
            "--optim.lr", "1e-3", "--data.streaming", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def parquet_set(tmp_path_factory):
    """40 labeled images, each a solid grey level of its own (so an image names its example), written as 4
    parquet files: a local stand-in for a hub dataset with 4 shards."""
    import datasets

    root = tmp_path_factory.mktemp("stream")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])})
    images = [Image.new("L", (36, 36), 5 * i).convert("RGB") for i in range(40)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [int(i >= 20) for i in range(40)]}, features=features)
    (root / "data").mkdir()
    for k in range(4):
        ds.shard(4, k, contiguous=True).to_parquet(str(root / "data" / f"train-{k:05d}.parquet"))
    return root


def ids(batch) -> list[int]:
    """The example behind each image of a batch (its grey level / 5)."""
    return [int(round(float(x[0, 0, 0]) / 5)) for x in batch["image"]]


def stream(path, rank=0, world=1, shuffle=True) -> StreamSamples:
    source = StreamSource(f"hf:{path}")

    def prepare(img, epoch, index):
        return {"image": torch.from_numpy(np.array(img)).permute(2, 0, 1), "noise": torch.zeros(1), "index": index}

    return StreamSamples(source, prepare, seed=0, rank=rank, world=world, in_chans=3, shuffle=shuffle)


def loader(samples, workers=0, batch=4) -> StreamLoader:
    from mae.data.transforms import collate_samples

    return StreamLoader(samples, batch_size=batch, collate_fn=collate_samples, num_workers=workers, device="cpu")


def test_the_size_comes_from_the_data_and_each_process_reads_its_part(parquet_set):
    source = StreamSource(f"hf:{parquet_set}")
    assert len(source) == 40 and source.dataset.n_shards == 4
    parts = []
    for rank in range(2):
        lo = loader(stream(parquet_set, rank=rank, world=2))
        lo.set_epoch(0)
        assert len(lo) == 5  # 20 examples per process, batches of 4
        parts.append([i for b in lo for i in ids(b)])
    assert sorted(parts[0] + parts[1]) == list(range(40))  # disjoint parts, nothing lost


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_from_each_workers_position(parquet_set, workers):
    """The resumed loader reads exactly the examples the interrupted one had not consumed."""
    first = loader(stream(parquet_set), workers)
    first.set_epoch(0)
    it = iter(first)
    consumed = [i for _ in range(4) for i in ids(next(it))]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    del it
    second = loader(stream(parquet_set), workers)
    second.load_state_dict(state)
    rest = [i for b in second.epoch_batches(0, skip=4) for i in ids(b)]
    assert len(rest) == 6 * 4 and sorted(consumed + rest) == list(range(40))


def test_epochs_differ_and_repeat_with_the_seed(parquet_set):
    def epoch(e):
        lo = loader(stream(parquet_set))
        lo.set_epoch(e)
        return [i for b in lo for i in ids(b)]

    assert epoch(0) == epoch(0) and epoch(0) != epoch(1) and sorted(epoch(1)) == list(range(40))


def test_pretraining_streams_and_resumes_mid_epoch(parquet_set, tmp_path):
    args = [*PRETRAIN, "--data.path", f"hf:{parquet_set}", "--loop.epochs", 2, "--loop.batch_size", 4,
            "--loop.checkpoint_every", 3, "--loop.keep_checkpoints", 10, "--data.num_workers", 2]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    AcceleratorState._reset_state(True)
    assert main(["pretrain", *map(str, args), "--output_dir", str(full)]) == 0
    assert (full / "checkpoints" / "step_00000003" / "stream_state_rank0.json").is_file()
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_00000003", part / "checkpoints" / "step_00000003")
    AcceleratorState._reset_state(True)
    assert main(["pretrain", *map(str, args), "--output_dir", str(part)]) == 0
    a, b = ([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
            for out in (full, part))  # fmt: skip
    assert [m["step"] for m in a] == list(range(1, 21))  # 10 steps per epoch, from the data's size
    assert [m["loss"] for m in b] == [m["loss"] for m in a][3:]  # the resumed run continues exactly
    wa = load_file(full / "checkpoints" / "step_00000020" / "model.safetensors")
    wb = load_file(part / "checkpoints" / "step_00000020" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_streaming_a_folder_is_one_line(tmp_path, capsys):
    from tests.conftest import make_images

    make_images(tmp_path / "imgs", n=8)
    AcceleratorState._reset_state(True)
    args = ["pretrain", *PRETRAIN, "--data.path", str(tmp_path / "imgs"), "--output_dir", str(tmp_path / "r")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data.streaming" in err[0] and "hf:" in err[0], err


def test_stream_source_gives_classes_and_checks_channels(parquet_set):
    from mae.errors import ChannelError

    source = StreamSource(f"hf:{parquet_set}", labeled=True)
    assert source.classes == ["dark", "light"]
    head = source.first_examples(3)
    assert head.load_array(0).shape == (36, 36, 3) and list(head.labels) == [0, 0, 0]
    with pytest.raises(ChannelError, match="3 channel"):
        source.decode(head.examples[0]["image"], 1, "example 0")


def labeled_args(parquet_set, tmp_path):
    import mae

    torch.manual_seed(0)
    encoder = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8", img_size=32), tmp_path / "enc.safetensors")
    return ["--pretrained", str(encoder), "--data.path", f"hf:{parquet_set}", "--data.val_path", f"hf:{parquet_set}",
            "--data.streaming", "true", "--data.num_workers", "0", "--loop.mixed_precision", "no",
            "--loop.batch_size", "8"]  # fmt: skip


def test_labeled_stages_stream(parquet_set, tmp_path):
    args = labeled_args(parquet_set, tmp_path)
    for stage, extra in (
        ("knn", []),
        ("linprobe", ["--loop.epochs", "2", "--loop.progress", "false"]),
        ("finetune", ["--loop.epochs", "1", "--loop.log_every", "1", "--loop.progress", "false"]),
    ):
        AcceleratorState._reset_state(True)
        assert main([stage, *args, *extra, "--output_dir", str(tmp_path / stage)]) == 0, stage
        lines = [json.loads(x) for x in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()]
        assert [m for m in lines if "top1" in m][-1]["samples"] == 40, stage  # every validation example, once
    steps = [m for m in map(json.loads, (tmp_path / "finetune" / "metrics.jsonl").read_text().splitlines())
             if "top1" not in m]  # fmt: skip
    assert len(steps) == 5  # 40 examples, batches of 8


def test_a_labeled_stream_needs_a_validation_set(parquet_set, tmp_path, capsys):
    args = [a for a in labeled_args(parquet_set, tmp_path)]
    i = args.index("--data.val_path")
    del args[i : i + 2]
    AcceleratorState._reset_state(True)
    assert main(["knn", *args, "--output_dir", str(tmp_path / "knn")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data.val_path" in err[0], err


@pytest.mark.slow
def test_two_processes_each_read_their_part_and_evaluate_everything(parquet_set, tmp_path):
    import os
    import subprocess
    import sys

    args = labeled_args(parquet_set, tmp_path)
    AcceleratorState._reset_state(True)
    assert main(["knn", *args, "--output_dir", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mae",
           "knn", *args, "--output_dir", str(tmp_path / "two")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1]) for d in ("one", "two"))
    assert two["samples"] == one["samples"] == 40 and abs(two["top1"] - one["top1"]) < 1e-6
    pre = [*PRETRAIN, "--data.path", f"hf:{parquet_set}", "--loop.epochs", "1", "--loop.batch_size", "4",
           "--data.num_workers", "1", "--output_dir", str(tmp_path / "pre")]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mae",
           "pretrain", *pre]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]  # 20 examples per process, batches of 4
