"""Linear probe, fine-tuning and k-NN on a generated labeled set, through the command line."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer

import mae
from mae.cli import main
from mae.train.features import knn_scores, topk_accuracy
from tests.conftest import make_labeled

COMMON = ["--data.num_workers", "0", "--loop.mixed_precision", "no", "--data.val_fraction", "0.25",
          "--loop.batch_size", "16"]  # fmt: skip
QUIET = ["--loop.progress", "false"]  # the training stages' bar (k-NN trains nothing and shows none)


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    return make_labeled(tmp_path_factory.mktemp("labeled"), per_class=40)


@pytest.fixture(scope="module")
def encoder(micro_encoder):
    return micro_encoder


def run(stage, *args) -> int:
    AcceleratorState._reset_state(True)
    return main([stage, *COMMON, *([] if stage == "knn" else QUIET), *map(str, args)])


def evals(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]


def classifier(path):
    meta = safe_open(str(path), "pt").metadata()
    model = timm.create_model(meta["architecture"], pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              **json.loads(meta["model_args"]))  # fmt: skip
    return model.eval(), meta


def test_eval_every_0_evaluates_once_at_the_end(tmp_path, labeled, encoder):
    """The Fashion-MNIST fine-tune recipe's setting: no evaluation between epochs, one after the last."""
    out = tmp_path / "probe"
    args = ["--pretrained", encoder, "--data.path", labeled, "--output_dir", out, "--loop.epochs", 3,
            "--loop.eval_every", 0]  # fmt: skip
    assert run("linprobe", *args) == 0
    assert [e["epoch"] for e in evals(out)] == [3]


@pytest.mark.parametrize("mode", ["cached", "augmented"])
def test_linprobe_learns_and_never_touches_the_encoder(tmp_path, labeled, encoder, mode, monkeypatch, evaluations):
    calls = {"n": 0}
    original = VisionTransformer.forward_features

    def counting(self, x, *a, **k):
        calls["n"] += 1
        return original(self, x, *a, **k)

    monkeypatch.setattr(VisionTransformer, "forward_features", counting)
    out = tmp_path / mode
    args = ["--pretrained", encoder, "--data.path", labeled, "--output_dir", out, "--loop.epochs", 8,
            "--mode", mode, "--augment", str(mode == "augmented").lower(), "--optim.optimizer", "sgd",
            "--optim.blr", 1.0, "--optim.warmup_epochs", 1, "--loop.eval_every", 4]  # fmt: skip
    assert run("linprobe", *args) == 0
    batches = 6 + 2  # one pass over 90 train + 30 val images in batches of 16
    if mode == "cached":
        assert calls["n"] == batches  # the encoder ran once over the data, never in the 8 epochs
    else:
        assert calls["n"] >= 8 * 5 + 2 * 2  # every epoch's batches and every evaluation
    last = evals(out)[-1]
    assert last["top1"] >= 80.0 and last["samples"] == 30  # chance is 33%
    # The exported classifier: the encoder bit-identical to the pretrained one, the head folded.
    model, meta = classifier(out / "classifier.safetensors")
    before = load_file(encoder)
    after = load_file(out / "classifier.safetensors")
    assert set(after) - set(before) == {"head.weight", "head.bias"} and set(before) <= set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads(meta["classes"]) == ["blue", "green", "red"]
    assert json.loads((out / "classes.json").read_text()) == ["blue", "green", "red"]
    # The folded head (BatchNorm into the linear layer) scores each held-out image as the stage's last evaluation did.
    logits, labels = export_logits(out, labeled)
    assert torch.equal(labels, evaluations[-1][1])
    torch.testing.assert_close(logits, evaluations[-1][0], atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. torch's on a read-only memory-mapped array
def test_cached_features_on_disk_are_read_back(tmp_path, labeled, encoder, monkeypatch, capsys):
    """--cache_dir: the first run encodes and writes the features, the second reads them (the encoder never runs)
    and trains the same probe."""
    args = ["--pretrained", encoder, "--data.path", labeled, "--loop.epochs", 2, "--mode", "cached",
            "--optim.optimizer", "sgd", "--cache_dir", tmp_path / "cache"]  # fmt: skip
    assert run("linprobe", *args, "--output_dir", tmp_path / "first") == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "cache.json", "train_features.npy", "train_labels.npy", "val_features.npy", "val_labels.npy"]  # fmt: skip

    def never(self, *a, **k):
        raise AssertionError("the encoder ran although the features were cached")

    monkeypatch.setattr(VisionTransformer, "forward_features", never)
    capsys.readouterr()
    assert run("linprobe", *args, "--output_dir", tmp_path / "second") == 0
    assert evals(tmp_path / "second")[-1] == evals(tmp_path / "first")[-1]
    assert [line for line in capsys.readouterr().out.splitlines() if "--cache_dir" in line] == [
        f"--cache_dir {tmp_path / 'cache'}: reading the features cached there (the same encoder, data and transform)"
    ]


def test_a_cache_made_otherwise_is_made_again(tmp_path, labeled, encoder, capsys):
    """--cache_dir shared by runs that would make other features: each computes its own, overwrites the cache and
    says in one line which part differed. A zeroed encoder gives every image the same features, so its probe
    cannot tell the classes apart: its top-1 is not the first encoder's, as it was when it read the first's cache."""
    zeroed = mae.create_mae("mae_vit_micro_patch8")
    for p in zeroed.encoder.parameters():
        torch.nn.init.zeros_(p)
    zeroed = mae.export_encoder(zeroed, tmp_path / "zeroed.safetensors")
    cache = tmp_path / "cache"
    common = ["--data.path", labeled, "--loop.epochs", 4, "--mode", "cached", "--optim.optimizer", "sgd",
              "--optim.blr", 1.0, "--optim.warmup_epochs", 1, "--cache_dir", cache]  # fmt: skip

    def probe(name, pretrained, *args):
        capsys.readouterr()
        assert run("linprobe", *common, "--pretrained", pretrained, "--output_dir", tmp_path / name, *args) == 0
        said = [line for line in capsys.readouterr().out.splitlines() if "--cache_dir" in line]
        return evals(tmp_path / name)[-1]["top1"], said

    first, said = probe("first", encoder)
    assert first >= 80.0 and said == []  # chance is 33%; an empty cache is filled without a word
    second, said = probe("second", zeroed)
    assert second < 60.0 and second != first
    assert len(said) == 1 and said[0].startswith(f"--cache_dir {cache}: computing the features again, overwriting")
    assert "they were made by another encoder (weights_sha256 " in said[0]
    assert not np.load(cache / "train_features.npy").any()  # the zeroed encoder's features, not the first's
    _, said = probe("crop", zeroed, "--data.crop_pct", 1.0)
    assert len(said) == 1 and said[0].endswith("they were made with another transform (crop_pct 0.875, this run's 1.0)")
    _, said = probe("split", zeroed, "--data.crop_pct", 1.0, "--data.val_fraction", 0.5)
    assert len(said) == 1 and "they were made from other data (train.fingerprint " in said[0]
    (cache / "cache.json").unlink()  # as an older version (or an interrupted write) leaves it
    _, said = probe("unrecorded", encoder)
    assert len(said) == 1 and said[0].endswith("no cache.json says what made them (written by an older version, or "
                                               "interrupted)")  # fmt: skip
    again, said = probe("again", encoder)
    assert again == first and "reading the features cached there" in said[0]


def export_logits(out, data) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, C], labels [N]) of the classifier a run exported over the run's held-out split, image by image."""
    from PIL import Image

    from mae.data.labeled import split
    from mae.data.open import open_source

    clf = mae.load_classifier(out / "classifier.safetensors")
    _, val = split(open_source(data, labeled=True), 0.25, seed=0)
    logits = []
    for i in range(len(val)):
        with Image.open(val.name(i)) as img:
            x = clf.transform(img.convert("RGB")).unsqueeze(0)
        with torch.no_grad():
            logits.append(clf.model.eval()(x)[0])
    return torch.stack(logits), torch.as_tensor([int(y) for y in val.labels])


def test_finetune_trains_everything_with_layer_decay(tmp_path, labeled, encoder):
    out = tmp_path / "ft"
    assert run("finetune", "--pretrained", encoder, "--data.path", labeled, "--output_dir", out, "--loop.epochs", 2,
               "--loop.log_every", 1, "--optim.warmup_epochs", 0.5) == 0  # fmt: skip
    before, after = load_file(encoder), load_file(out / "classifier.safetensors")
    unchanged = [k for k in before if k in after and torch.equal(before[k], after[k])]
    assert unchanged == []
    assert {"head.weight", "fc_norm.weight"} <= set(after)
    line = next(m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "group_lrs" in m)
    depth = 3
    expected = {round(line["lr"] * 0.75 ** (depth + 1 - layer), 12) for layer in range(depth + 2)}
    assert {round(x, 12) for x in line["group_lrs"]} == expected
    model, _ = classifier(out / "classifier.safetensors")
    assert model.global_pool == "avg" and model.head.out_features == 3
    assert evals(out)[-1]["top1"] > 50.0


@pytest.mark.parametrize("frozen", [1, 3])
def test_partial_finetune_keeps_the_stem_and_first_blocks(tmp_path, labeled, encoder, capsys, frozen):
    """--model.frozen_blocks N: the stem and blocks 0..N-1 leave as they came, every later layer and the head train;
    past the encoder's depth it is a one-line error."""
    out = tmp_path / "ft"
    args = ["--pretrained", encoder, "--data.path", labeled, "--loop.epochs", 1, "--optim.warmup_epochs", 0.2]
    assert run("finetune", *args, "--model.frozen_blocks", frozen, "--output_dir", out) == 0
    before, after = load_file(encoder), load_file(out / "classifier.safetensors")
    kept = {k for k in before if k in after and torch.equal(before[k], after[k])}
    frozen_keys = {k for k in before if k.startswith(("patch_embed.", "cls_token"))}
    frozen_keys |= {k for k in before if k.startswith("blocks.") and int(k.split(".")[1]) < frozen}
    assert kept - {"pos_embed"} == frozen_keys  # pos_embed: the fixed sine-cosine table, never trained
    assert evals(out)[-1]["top1"] > 0
    assert run("finetune", *args, "--model.frozen_blocks", 4, "--output_dir", tmp_path / "bad") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--model.frozen_blocks 4: the encoder has 3 blocks; choose 0 to 3"), err[-1]


def test_partial_finetune_under_fsdp1_needs_the_original_parameters(tmp_path, labeled, encoder, capsys, monkeypatch):
    """FSDP version 1 flattens each unit's parameters into one that must all train or all not: without
    use_orig_params, frozen blocks end the run with one line before any wrapping (FSDP runs on GPUs only,
    so its plugin is stood in for here)."""
    plugin = SimpleNamespace(fsdp_version=1, use_orig_params=False)
    monkeypatch.setattr(AcceleratorState, "fsdp_plugin", plugin, raising=False)
    args = ["--pretrained", encoder, "--data.path", labeled, "--loop.epochs", 1, "--output_dir", tmp_path / "ft"]
    assert run("finetune", *args, "--model.frozen_blocks", 2) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "--model.frozen_blocks 2 under FSDP version 1 needs fsdp_use_orig_params: true in the Accelerate config (or "
        "fsdp_version: 2); or set --model.frozen_blocks 0"
    ), err[-1]
    plugin.use_orig_params = True  # then the run goes on (here without FSDP: a CPU has none)
    assert run("finetune", *args, "--model.frozen_blocks", 2) == 0


def test_knn_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    bank, bank_labels = torch.randn(200, 16, generator=g), torch.randint(0, 7, (200,), generator=g)
    query, labels = torch.randn(30, 16, generator=g), torch.randint(0, 7, (30,), generator=g)
    scores = knn_scores(bank, bank_labels, query, num_classes=7, k=10, temperature=0.07, chunk=7)
    for i in range(30):
        sims = [float(torch.dot(query[i], b) / (query[i].norm() * b.norm())) for b in bank]
        nearest = sorted(range(200), key=lambda j: -sims[j])[:10]
        votes = [0.0] * 7
        for j in nearest:
            votes[int(bank_labels[j])] += torch.tensor(sims[j] / 0.07).exp().item()
        torch.testing.assert_close(scores[i], torch.tensor(votes), rtol=1e-4, atol=1e-4)
    assert set(topk_accuracy(scores, labels)) == {"top1", "top5"}


def test_topk_accuracy_counts_the_labels_ranked_within_k():
    g = torch.Generator().manual_seed(1)
    scores, labels = torch.randn(30, 7, generator=g), torch.randint(0, 7, (30,), generator=g)
    acc = topk_accuracy(scores, labels)
    # a label is in the top k when fewer than k classes score higher than it (no ties among random scores)
    above = [sum(float(s) > float(row[int(y)]) for s in row) for row, y in zip(scores, labels, strict=True)]
    assert acc["top1"] == pytest.approx(100 * sum(a < 1 for a in above) / 30)
    assert acc["top5"] == pytest.approx(100 * sum(a < 5 for a in above) / 30)
    assert 0 < acc["top1"] < acc["top5"] < 100  # the data make both informative


def test_knn_stage_and_random_baseline(tmp_path, labeled, encoder):
    assert run("knn", "--pretrained", encoder, "--data.path", labeled, "--output_dir", tmp_path / "a") == 0
    line = evals(tmp_path / "a")[0]
    assert {"step", "epoch", "loss", "top1"} <= set(line) and line["top1"] >= 80 and line["samples"] == 30
    assert run("knn", "--pretrained", "random:mae_vit_micro_patch8", "--data.path", labeled,
               "--output_dir", tmp_path / "b") == 0  # fmt: skip


@pytest.mark.slow
def test_two_processes_give_the_same_top1(tmp_path, labeled, encoder):
    args = ["knn", *COMMON, "--pretrained", str(encoder), "--data.path", str(labeled), "--data.val_fraction", "0.3"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "mae", *args, "--output_dir", str(tmp_path / "two")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[:3000]
    AcceleratorState._reset_state(True)
    assert main([*args, "--output_dir", str(tmp_path / "one")]) == 0
    one, two = evals(tmp_path / "one")[0], evals(tmp_path / "two")[0]
    assert one["samples"] == two["samples"] == 36  # 36 of 120: uneven over 2 processes x batch 16, counted exactly
    assert one["top1"] == two["top1"]


@pytest.mark.slow
def test_two_processes_share_one_feature_cache(tmp_path, labeled, encoder):
    """Two processes decide alike whether --cache_dir's features are theirs (or the gathers would not match): a run
    of another encoder computes its own and writes them once, and one process then reads them as its own."""
    cache = tmp_path / "cache"
    args = ["linprobe", *COMMON, "--data.path", str(labeled), "--loop.epochs", "2", "--mode", "cached",
            "--optim.optimizer", "sgd", "--cache_dir", str(cache)]  # fmt: skip
    torch.manual_seed(1)  # (random:mae_vit_micro_patch8 at --seed 0 has the fixture's very weights, and features)
    other = str(mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "other.safetensors"))
    for name, pretrained in (("first", encoder), ("other", other)):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "mae", *args, "--pretrained", str(pretrained), "--output_dir", str(tmp_path / name)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("computing the features again") == 1  # said once, by the main process
    assert json.loads((cache / "cache.json").read_text())["pretrained"] == other
    # what the two processes wrote is what one process makes of that encoder, and one process reads it back
    AcceleratorState._reset_state(True)
    alone = [*args[:-1], str(tmp_path / "alone"), "--pretrained", other]
    assert main([*alone, "--output_dir", str(tmp_path / "one")]) == 0
    for name in ("train_features", "train_labels", "val_features", "val_labels"):
        assert np.array_equal(np.load(cache / f"{name}.npy"), np.load(tmp_path / "alone" / f"{name}.npy")), name
    AcceleratorState._reset_state(True)
    assert main([*args, "--pretrained", other, "--output_dir", str(tmp_path / "read")]) == 0
    assert evals(tmp_path / "read")[-1] == evals(tmp_path / "one")[-1]


@pytest.mark.parametrize(
    "case,expected",
    [
        ("single", "at least two classes (found 1)"),
        ("empty", "class folder 'b' has no images"),
        ("missing_pretrained", "--pretrained /no/such: no such file or folder"),
        ("wrong_pretrained", "not a ViT MAE checkpoint"),
        ("no_pretrained", "--pretrained: required"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, labeled, encoder, case, expected):
    data, pretrained = labeled, str(encoder)
    if case in ("single", "empty"):
        data = tmp_path / "d"
        make_labeled(tmp_path / "src", per_class=4)
        (data / "a").mkdir(parents=True)
        for f in (tmp_path / "src" / "red").iterdir():
            (data / "a" / f.name).write_bytes(f.read_bytes())
        if case == "empty":
            (data / "b").mkdir()
    if case == "missing_pretrained":
        pretrained = "/no/such"
    if case == "wrong_pretrained":
        pretrained = str(tmp_path / "resnet.pth")
        import torchvision

        torch.save(torchvision.models.resnet18().state_dict(), pretrained)
    args = ["--data.path", data, "--output_dir", tmp_path / "o"]
    if case != "no_pretrained":
        args += ["--pretrained", pretrained]
    assert run("linprobe", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_labels_out_of_range_in_a_dataset(tmp_path, capsys):
    import datasets
    from PIL import Image

    imgs = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(6)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": imgs, "label": [0, 1, 2, 0, 1, -1]}, features=features)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert run("knn", "--pretrained", "random:mae_vit_micro_patch8", "--data.path", tmp_path / "ds",
               "--output_dir", tmp_path / "o") == 2  # fmt: skip
    assert "label -1 of row 5 is outside [0, 3)" in capsys.readouterr().err


def test_finetune_with_ema_exports_the_average(tmp_path, labeled, encoder):
    args = ["--pretrained", encoder, "--data.path", labeled, "--loop.epochs", 1, "--optim.warmup_epochs", 0.2]
    assert run("finetune", *args, "--output_dir", tmp_path / "raw") == 0
    assert run("finetune", *args, "--model.ema_decay", 0.5, "--output_dir", tmp_path / "ema") == 0
    raw, ema = (
        load_file(tmp_path / "raw" / "classifier.safetensors"),
        load_file(tmp_path / "ema" / "classifier.safetensors"),
    )
    pre = load_file(encoder)
    # same seed, same steps: the EMA export lies between the start and the raw weights, equal to neither
    w = "blocks.0.mlp.fc1.weight"
    assert not torch.equal(ema[w], raw[w]) and not torch.equal(ema[w], pre[w])
    assert (ema[w] - pre[w]).norm() < (raw[w] - pre[w]).norm()
    assert "top1" in evals(tmp_path / "ema")[-1]


@pytest.mark.slow
def test_compiled_finetune_and_knn_match_eager(tmp_path, labeled, encoder):
    args = ["--pretrained", encoder, "--data.path", labeled]
    ft = [*args, "--loop.epochs", 1, "--optim.warmup_epochs", 0.5, "--loop.log_every", 1]  # k-NN logs no steps
    assert run("finetune", *ft, "--output_dir", tmp_path / "ft") == 0
    assert run("finetune", *ft, "--loop.compile", "true", "--output_dir", tmp_path / "ft_compiled") == 0
    eager, compiled = (
        [json.loads(x)["loss"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines() if "eval" not in x]
        for d in ("ft", "ft_compiled")
    )
    assert len(eager) == len(compiled) > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-4)
    weights = load_file(tmp_path / "ft_compiled" / "classifier.safetensors")
    assert not [k for k in weights if "_orig_mod" in k]
    classifier(tmp_path / "ft_compiled" / "classifier.safetensors")  # loads strictly into timm
    assert run("knn", *args, "--output_dir", tmp_path / "knn") == 0
    assert run("knn", *args, "--loop.compile", "true", "--output_dir", tmp_path / "knn_compiled") == 0
    assert abs(evals(tmp_path / "knn")[0]["top1"] - evals(tmp_path / "knn_compiled")[0]["top1"]) < 1e-6


def test_probe_optimizer_follows_the_batch_and_warns_of_lars_at_small_batches(tmp_path, labeled, encoder, capsys):
    common = ["--pretrained", encoder, "--data.path", labeled, "--loop.epochs", 1, "--optim.warmup_epochs", 0]
    assert run("linprobe", *common, "--output_dir", tmp_path / "auto") == 0
    out = capsys.readouterr()
    assert ", sgd) on" in out.out and "warning" not in out.err  # auto: SGD at an effective batch of 16
    assert run("linprobe", *common, "--optim.optimizer", "lars", "--output_dir", tmp_path / "lars") == 0
    err = capsys.readouterr().err
    assert "warning: --optim.optimizer lars at an effective batch of 16" in err


def test_a_random_init_baseline_follows_the_seed(tmp_path, labeled):
    """`--pretrained random:PRESET`: the same command gives the same classifier; another seed another one."""
    args = ["--pretrained", "random:mae_vit_micro_patch8", "--data.path", labeled, "--model.img_size", 32,
            "--loop.epochs", 1, "--optim.warmup_epochs", 0]  # fmt: skip
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert run("finetune", *args, "--seed", seed, "--output_dir", tmp_path / name) == 0
    a, b, c = (load_file(tmp_path / name / "classifier.safetensors") for name in "abc")
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
