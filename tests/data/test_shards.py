"""Shard sets: `mae shard` writes them; every stage reads them with the guarantees folders have."""

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors.torch import load_file

import mae
from mae.cli import main
from mae.data.folder import FolderSource
from mae.data.open import open_source
from mae.data.samplers import EpochSampler
from mae.data.shard_writer import write_shards
from mae.data.shards import INDEX, open_shards

PRETRAIN = ["--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--data.num_workers", "0",
            "--loop.progress", "false", "--loop.mixed_precision", "no", "--loop.log_every", "1",
            "--optim.warmup_epochs", "0.5", "--optim.lr", "1e-3"]  # fmt: skip


def make_jpegs(root: Path, per_class: int = 16, size: int = 40, seed: int = 0) -> Path:
    """Class folders of generated JPEGs (smooth textures whose dominant hue is the class)."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(["red", "green", "blue"]):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            coarse = rng.uniform(0, 120, (4, 4, 3))
            coarse[..., label] += rng.uniform(60, 135, (4, 4))
            img = Image.fromarray(coarse.astype("uint8")).resize((size, size), Image.BICUBIC)
            img.save(root / name / f"{i:03d}.jpg", quality=90)
    return root


def cli(stage: str, *args) -> int:
    AcceleratorState._reset_state(True)
    return main([stage, *map(str, args)])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """48 labeled JPEGs and the 4 shards `mae shard` makes of them."""
    root = tmp_path_factory.mktemp("shards")
    folder = make_jpegs(root / "jpegs")
    assert cli("shard", folder, "--output", root / "shards", "--samples_per_shard", 12) == 0
    return folder, root / "shards"


def test_mae_shard_writes_tar_shards_and_an_index(corpus):
    folder, shards = corpus
    index = json.loads((shards / INDEX).read_text())
    assert [s["nsamples"] for s in index["shardlist"]] == [12] * 4
    assert sorted(p.name for p in shards.iterdir()) == [INDEX] + [f"shard-{k:06d}.tar" for k in range(4)]
    assert index["classes"] == ["blue", "green", "red"] and index["options"]["samples_per_shard"] == 12
    # Every image stored as it was (bytes untouched), with its class, in a shuffled order.
    original = open_source(str(folder), labeled=True)
    read = open_shards(str(shards), labeled=True)
    keys = [int(read.name(i).rsplit(":", 1)[1]) for i in range(len(read))]
    assert sorted(keys) == list(range(48)) and keys != list(range(48))
    for i, key in enumerate(keys):
        assert read.raw(i) == (Path(original.paths[key]).read_bytes(), "jpg")
        assert read.labels[i] == original.labels[key]
    assert np.array_equal(np.asarray(read.load(0)), np.asarray(original.load(keys[0])))


def test_every_form_of_the_path_reads_the_same_set(corpus, tmp_path, monkeypatch):
    _, shards = corpus
    monkeypatch.setenv("MAE_SHARD_CACHE", str(tmp_path / "cache"))
    piped = open_source(f"pipe:cat {shards}/shard-{{000000..000003}}.tar")  # a URL form: fetched into the cache
    assert len(piped) == 48 and len(list((tmp_path / "cache").iterdir())) == 4
    by_folder = open_source(str(shards))
    brace = open_source(str(shards / "shard-{000000..000003}.tar"))
    by_index = open_source(str(shards / INDEX))
    # without an index the shards are counted (and their labels read) once
    bare = tmp_path / "bare"
    shutil.copytree(shards, bare)
    (bare / INDEX).unlink()
    counted = open_source(str(bare / "shard-{000000..000003}.tar"), labeled=True)
    assert len(by_folder) == len(brace) == len(by_index) == len(counted) == 48
    assert [brace.name(i).rsplit(":", 1)[1] for i in range(48)] == [
        by_folder.name(i).rsplit(":", 1)[1] for i in range(48)
    ]
    assert list(counted.labels) == list(open_source(str(shards), labeled=True).labels)
    assert open_source(str(shards / "shard-000002.tar")).__len__() == 12


def test_shard_local_order_is_a_seeded_permutation():
    ends = np.cumsum([5, 7, 3, 9] * 5)
    s = EpochSampler(int(ends[-1]), seed=3, shard_ends=ends)
    s.set_epoch(1)
    a = [i for _, i in s]
    assert sorted(a) == list(range(int(ends[-1]))) and a == [i for _, i in s]
    s.set_epoch(2)
    assert [i for _, i in s] != a
    # locality: the first window (8 shards, >= 24 samples) is read before any other shard
    shard_of = np.searchsorted(ends, a[:24], side="right")
    assert len(set(shard_of.tolist())) <= 8


LOADER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from dataclasses import replace
    from accelerate import Accelerator
    from mae.config import PretrainConfig
    from mae.data.open import open_source
    from mae.data.transforms import PretrainSamples, collate_samples
    from mae.train.loaders import training_loader

    acc = Accelerator(cpu=True)
    source = open_source(sys.argv[1])
    samples = PretrainSamples(source, img_size=(32, 32), patch_size=8, seed=0)
    cfg = PretrainConfig()
    cfg = replace(cfg, loop=replace(cfg.loop, batch_size=4))
    sampler, loader = training_loader(cfg, samples, collate_samples, num_workers=2)
    loader = acc.prepare(loader)
    seen = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        sampler.set_epoch(epoch)
        seen[epoch] = [source.name(int(i)) for batch in loader for i in batch["index"]]
    with open(os.path.join(sys.argv[2], f"rank{acc.process_index}.json"), "w") as f:
        json.dump(seen, f)
    os._exit(0)  # the persistent workers ignore SIGTERM (stop signals are the trainer's); `mae` kills them at exit
    """
)


@pytest.mark.slow
def test_two_processes_with_two_workers_see_every_key_once_per_epoch(corpus, tmp_path):
    _, shards = corpus
    script = tmp_path / "loader.py"
    script.write_text(LOADER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(mae.__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(shards), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    every = {open_source(str(shards)).name(i) for i in range(48)}
    for epoch in ("0", "1"):
        names = ranks[0][epoch] + ranks[1][epoch]
        assert len(names) == 48 and set(names) == every  # 48 = 6 global batches of 8: nothing dropped
    assert ranks[0]["0"] != ranks[0]["1"]  # a new order each epoch


def test_pretraining_from_shards_resumes_mid_epoch_bit_identical(corpus, tmp_path):
    _, shards = corpus
    args = [*PRETRAIN, "--data.path", shards, "--loop.epochs", 2, "--loop.batch_size", 8,
            "--loop.checkpoint_every", 3, "--loop.keep_checkpoints", 10]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli("pretrain", *args, "--output_dir", full) == 0
    (part / "checkpoints").mkdir(parents=True)  # killed after step 3 of the epoch's 6
    shutil.copytree(full / "checkpoints" / "step_00000003", part / "checkpoints" / "step_00000003")
    assert cli("pretrain", *args, "--output_dir", part) == 0
    a = load_file(full / "checkpoints" / "step_00000012" / "model.safetensors")
    b = load_file(part / "checkpoints" / "step_00000012" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "eval" not in m]
    assert [m["step"] for m in steps] == list(range(1, 13))  # steps per epoch from the index: exact
    assert all(0.0 <= m["data_wait"] <= 1.0 for m in steps)


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_losses_from_shards(corpus, tmp_path):
    _, shards = corpus
    common = [*PRETRAIN, "--data.path", str(shards), "--loop.epochs", "1", "--data.num_workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mae",
           "pretrain", *common, "--loop.batch_size", "4", "--output_dir", str(tmp_path / "two")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli("pretrain", *common, "--loop.batch_size", 8, "--output_dir", tmp_path / "one") == 0

    def losses(out):
        return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]

    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 6
    assert all(abs(x - y) < 1e-5 for x, y in zip(one, two, strict=True))


def test_a_corrupt_member_is_skipped_with_one_warning(tmp_path, recwarn):
    folder = make_jpegs(tmp_path / "jpegs", per_class=4)
    bad = folder / "red" / "001.jpg"
    bad.write_bytes(bad.read_bytes()[:50])  # a truncated JPEG: its header survives, its data does not
    assert cli("shard", folder, "--output", tmp_path / "shards", "--samples_per_shard", 6) == 0
    out = tmp_path / "run"
    assert cli("pretrain", *PRETRAIN, "--data.path", tmp_path / "shards", "--loop.epochs", 2,
               "--loop.batch_size", 4, "--output_dir", out) == 0  # fmt: skip
    warned = [str(w.message) for w in recwarn if "skipping" in str(w.message)]
    assert len(warned) == 1 and ".tar:0000000" in warned[0] and "shard-00000" in warned[0], warned
    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x][-1]
    assert last["skipped_files"] == 1


@pytest.mark.parametrize("damage", ["missing", "not_a_tar", "unreadable"])
def test_a_missing_or_unreadable_shard_is_one_line_before_training(corpus, tmp_path, capsys, damage):
    _, shards = corpus
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    victim = broken / "shard-000002.tar"
    if damage == "missing":
        victim.unlink()
    elif damage == "not_a_tar":
        victim.write_bytes(b"not a tar file" * 100)
    else:  # a folder where the file should be (permissions would not stop root, who runs CI)
        victim.unlink()
        victim.mkdir()
    out = tmp_path / "run"
    assert cli("pretrain", *PRETRAIN, "--data.path", broken, "--loop.epochs", 1, "--output_dir", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard-000002.tar" in err[0], err
    assert not (out / "metrics.jsonl").exists()


def test_labeled_stages_read_labeled_shards(corpus, tmp_path):
    _, shards = corpus
    torch.manual_seed(0)
    encoder = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8", img_size=32), tmp_path / "enc.safetensors")
    common = ["--pretrained", encoder, "--data.path", shards, "--data.num_workers", "0", "--loop.mixed_precision", "no",
              "--loop.batch_size", 8, "--data.val_fraction", 0.25]  # fmt: skip
    train = ["--loop.progress", "false", "--loop.epochs", 1]
    assert cli("knn", *common, "--output_dir", tmp_path / "knn") == 0
    assert cli("linprobe", *common, *train, "--output_dir", tmp_path / "probe") == 0
    assert cli("finetune", *common, *train, "--output_dir", tmp_path / "ft",
               "--data.val_path", shards) == 0  # fmt: skip
    for run in ("knn", "probe", "ft"):
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        evals = [m for m in lines if "top1" in m or "knn_top1" in m]
        # 48 images: a quarter held out, or all of them where they are also the validation set
        assert evals and evals[-1]["samples"] == {"knn": 12, "probe": 12, "ft": 48}[run], (run, evals[-1])


def test_unlabeled_shards_are_refused_by_labeled_stages(tmp_path, capsys):
    from tests.conftest import make_images

    make_images(tmp_path / "imgs", n=8)
    assert cli("shard", tmp_path / "imgs", "--output", tmp_path / "shards") == 0
    assert "index.json" in capsys.readouterr().out
    import mae

    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")  # a real one
    for stage in ("knn", "linprobe", "finetune"):
        code = cli(stage, "--pretrained", enc, "--data.path", tmp_path / "shards", "--output_dir", tmp_path / stage)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "no labels" in err[0] and "--data.path" in err[0], err
    # labels on request: refused for unlabeled images; left out on request for class folders
    assert cli("shard", tmp_path / "imgs", "--output", tmp_path / "forced", "--labeled", "true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "class" in err[0], err
    folder = make_jpegs(tmp_path / "jpegs", per_class=2)
    assert cli("shard", folder, "--output", tmp_path / "plain", "--labeled", "false") == 0
    index = json.loads((tmp_path / "plain" / INDEX).read_text())
    assert index["classes"] is None and "labels" not in index["shardlist"][0]


def test_max_size_shrinks_large_images_only_and_keeps_precision(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(src / "big.jpg", quality=90)
    Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(src / "small.png")
    Image.fromarray(rng.integers(0, 65535, (200, 100), dtype=np.uint16)).save(src / "deep.png")
    np.save(src / "bands.npy", rng.random((150, 90, 13)).astype(np.float32))
    source = FolderSource(src)
    write_shards(source, tmp_path / "out", max_size=64, progress=False, shuffle=False)
    read = open_shards(str(tmp_path / "out"))
    by_name = {Path(source.name(i)).name: i for i in range(len(source))}
    with Image.open(io.BytesIO(read.raw(by_name["big.jpg"])[0])) as img:
        assert img.format == "JPEG" and img.size == (64, 48)
    assert read.raw(by_name["small.png"])[0] == (src / "small.png").read_bytes()  # small: untouched
    deep = read.load_array(by_name["deep.png"])
    assert deep.shape == (64, 32, 1) and len(np.unique(deep)) > 256  # still 16-bit, not 8
    assert read.load_array(by_name["bands.npy"]).shape == (64, 38, 13)
    assert (src / "big.jpg").stat().st_size > 1000 and Image.open(src / "big.jpg").size == (400, 300)


def test_an_interrupted_shard_run_leaves_no_shard_set(tmp_path, monkeypatch):
    folder = make_jpegs(tmp_path / "jpegs", per_class=4)
    import mae.data.shard_writer as shards_module

    calls = {"n": 0}
    original = shards_module._raw_image

    def dying(source, i):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return original(source, i)

    monkeypatch.setattr(shards_module, "_raw_image", dying)
    with pytest.raises(KeyboardInterrupt):
        write_shards(open_source(str(folder), labeled=True), tmp_path / "out", samples_per_shard=4, progress=False)
    assert not (tmp_path / "out" / INDEX).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar.partial",
    ]
    with pytest.raises(Exception, match="no images found|not a shard index"):
        open_source(str(tmp_path / "out"))
    monkeypatch.setattr(shards_module, "_raw_image", original)
    write_shards(open_source(str(folder), labeled=True), tmp_path / "out", samples_per_shard=4, progress=False)
    assert len(open_source(str(tmp_path / "out"))) == 12
    assert not list((tmp_path / "out").glob("*.partial"))
