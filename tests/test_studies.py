"""studies/: the shared harness (a stage runs once, its last evaluation read back, one line on failure), the public
API as the studies' only door into `mae`, and each study's own logic on tiny synthetic data.

`studies` is a folder at the repository root, not part of the installed package: the tests import it because
tests/ is a package, so pytest puts the repository root on sys.path (the studies run from there, `python -m`)."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import mae
from studies import anomaly, anomaly_scores, continued, harness

ROOT = Path(__file__).resolve().parents[1]


def test_studies_use_only_the_public_api():
    """No study imports a `mae` internal (`mae.train`, `mae.anomaly_maps`, ...) or reaches another module through
    sys.path: `import mae` and `from mae import <exported name>` only."""
    for path in sorted((ROOT / "studies").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name == "mae" or not a.name.startswith("mae.") for a in node.names), path.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mae"):
                assert node.module == "mae" and all(a.name in mae.__all__ for a in node.names), path.name
            elif isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                pytest.fail(f"{path.name}: sys.path")
        internal = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and getattr(n.value, "id", "") == "mae" and n.attr not in mae.__all__]  # fmt: skip
        assert not internal, f"{path.name} uses mae.{internal[0]}, which mae does not export"


def test_harness_runs_a_stage_once_reads_its_last_evaluation_and_fails_in_one_line(tmp_path, monkeypatch):
    calls = []

    def knn(config=None, **overrides):
        calls.append((config, overrides))
        out = Path(overrides["output_dir"])
        out.mkdir(parents=True)
        lines = [{"step": 1, "loss": 1.0}, {"step": 2, "top1": 50.0}, {"step": 3, "loss": 0.5}]
        lines.append({"step": 4, "top1": 61.5})
        (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    monkeypatch.setattr(mae, "knn", knn)
    run = tmp_path / "runs" / "knn_1.5e-3"  # a dotted name: RUN.seconds is appended, not a changed suffix
    seconds = harness.stage("knn", run, "recipe.yaml", pretrained="enc", data={"path": "x"})
    assert calls == [("recipe.yaml", {"output_dir": str(run), "pretrained": "enc", "data": {"path": "x"}})]
    assert harness.finished(run) and (tmp_path / "runs" / "knn_1.5e-3.seconds").read_text() == str(seconds)
    assert harness.stage("knn", run, "recipe.yaml") == seconds and len(calls) == 1  # finished: not run again
    assert harness.last_eval(run) == {"step": 4, "top1": 61.5}

    def refuses(config=None, **overrides):
        raise mae.ConfigError("--loop.epochs 0: must be >= 1")

    monkeypatch.setattr(mae, "knn", refuses)
    with pytest.raises(SystemExit) as exit_:
        harness.stage("knn", tmp_path / "bad", loop={"epochs": 0})
    assert str(exit_.value.code) == f"study: mae.knn into {tmp_path / 'bad'}: --loop.epochs 0: must be >= 1"
    assert not harness.finished(tmp_path / "bad")


def test_harness_merges_recipe_sections_and_writes_the_report(tmp_path, capsys):
    merged = harness.merge({"loop": {"epochs": 14, "batch_size": 128}, "init": "a"}, {"loop": {"epochs": 1}})
    assert merged == {"loop": {"epochs": 1, "batch_size": 128}, "init": "a"}
    harness.report(tmp_path, "results", "| a |\n|---|", {"rows": [1]})
    assert (tmp_path / "results.md").read_text() == "| a |\n|---|\n" and "| a |" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text()) == {"rows": [1]}


def test_anomaly_study_chooses_on_held_out_training_images_only():
    """val is a seeded tenth of the normal class's training images, held out of the fit, beside 9 times as many of
    the other classes' training images; each method's setting, and the MAE's method, is the best on val."""
    labels = np.arange(1000) % 10
    images = np.arange(1000)[:, None, None] * np.ones((1, 2, 2), np.int64)  # image i holds the value i
    fit, val, anomalous = anomaly.split(images, labels, 3, seed=0)
    fit_ids, val_ids = fit[:, 0, 0], val[:, 0, 0]
    assert len(fit_ids) == 90 and (labels[fit_ids] == 3).all()
    assert anomalous.sum() == 90 and (~anomalous).sum() == 10
    assert (labels[val_ids[~anomalous]] == 3).all() and (labels[val_ids[anomalous]] != 3).all()
    assert not set(fit_ids) & set(val_ids) and len(set(val_ids)) == 100
    again = anomaly.split(images, labels, 3, seed=0)[1][:, 0, 0]
    other_seed = anomaly.split(images, labels, 3, seed=1)[1][:, 0, 0]
    assert (again == val_ids).all() and set(other_seed) != set(val_ids)

    val_auroc = {"mae recon @ mean": 0.7, "mae recon @ top5%": 0.9, "mae knn features": 0.8,
                 "mae gaussian features @ 0.001": 0.95, "mae gaussian features @ 0.1": 0.85,
                 "random-init gaussian features @ 0.001": 0.6, "random-init gaussian features @ 0.1": 0.65,
                 "pca error": 0.75}  # fmt: skip
    chosen = anomaly.choose({"val": {"mean over seeds": val_auroc}})
    assert chosen == {"mae recon": "mae recon @ top5%", "mae knn features": "mae knn features",
                      "mae gaussian features": "mae gaussian features @ 0.001",
                      "random-init gaussian features": "random-init gaussian features @ 0.1",
                      "pca error": "pca error", "mae": "mae gaussian features @ 0.001"}  # fmt: skip


def test_anomaly_auroc_counts_ties_half():
    assert anomaly_scores.auroc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert anomaly_scores.auroc(np.array([0.4, 0.3, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0
    assert anomaly_scores.auroc(np.array([0.5, 0.5, 0.5]), np.array([0, 1, 1])) == 0.5
    assert anomaly_scores.auroc(np.array([0.1, 0.3, 0.2, 0.4]), np.array([0, 0, 1, 1])) == 0.75


def namespace(tmp_path: Path, **kw) -> argparse.Namespace:
    defaults = {"output": tmp_path / "out", "keep": None, "override": {}, "rescore": False, "data": tmp_path / "none"}
    return argparse.Namespace(**{**defaults, **kw})


def test_anomaly_study_override_the_recipe_refuses_ends_with_one_line(tmp_path):
    """--override that `mae.pretrain` refuses: the run ends with one line naming it."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (40, 28, 28), dtype=np.uint8), np.arange(40) % 10
    for override, says in [
        ({"model": {"mask_ratio": 2}}, ""),
        ({"seed": 3}, "sets seed, which the study sets"),  # the study's own settings per class and seed
        ({"data": {"path": "x"}, "output_dir": "y"}, "sets output_dir, data.path, which the study sets"),
        ({"data": 5}, "data: not an object"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            anomaly.one_class(namespace(tmp_path, override=override), 3, 0, {"train": (x, y), "test": (x, y)})
        message = str(exit_.value.code)
        assert message.startswith(f"--override {json.dumps(override)}: {says}") and "\n" not in message


TINY = {"model": {"embed_dim": 16, "depth": 1, "num_heads": 1, "decoder_embed_dim": 16, "decoder_depth": 1,
                  "decoder_num_heads": 1},
        "loop": {"epochs": 1, "batch_size": 6}, "data": {"crop_scale": [1.0, 1.0], "hflip": False}}  # fmt: skip


def test_anomaly_study_scores_through_mae_anomaly_and_records_the_recipe_it_ran(tmp_path):
    """One class and seed end to end (a tiny recipe change): every method scored (the MAE's and its random-init
    twin's through `mae.anomaly` runs, raw pixels here), on val and test; the kept scores record the override and the
    recipe as pretrained (less what the study sets per class and seed), which tell runs of different recipes apart."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (200, 28, 28), dtype=np.uint8), np.arange(200) % 10
    args = namespace(tmp_path, keep=tmp_path / "keep", override=TINY)
    result = anomaly.one_class(args, 3, 0, {"train": (x, y), "test": (x, y)})
    recipe = result["recipe"]
    assert result["override"] == TINY and result["epochs"] == 1 and recipe["model"]["embed_dim"] == 16
    assert (recipe["data"]["crop_scale"], recipe["data"]["hflip"]) == ([1.0, 1.0], False)
    recipe_file = yaml.safe_load(anomaly.RECIPE.read_text())  # the override's batch size, the file's blr
    assert recipe["loop"]["batch_size"] == 6 and recipe["optim"]["blr"] == recipe_file["optim"]["blr"]
    assert "output_dir" not in recipe and "seed" not in recipe and not {"path", "mean", "std"} & set(recipe["data"])
    assert json.loads((tmp_path / "keep" / "class3_seed0.json").read_text()) == result
    methods = {f"mae {m}" for m in anomaly_scores.scorings(recon=True)}
    methods |= {f"random-init {m}" for m in anomaly_scores.scorings(recon=False)}
    methods |= {"knn raw pixels", "pca error", *(f"gaussian raw pixels @ {s:g}" for s in anomaly_scores.SHRINKAGES)}
    assert set(result["val"]) == set(result["test"]) == methods and "mae recon @ top1%" in methods
    assert all(0 <= v <= 1 for part in ("val", "test") for v in result[part].values())
    assert result["scoring"] == anomaly_scores.SCORING and "rescored on" not in result
    # each MAE method is its own `mae anomaly` run, whose metrics.json says what it scored
    settings = json.loads((tmp_path / "out" / "class3_seed0" / "scores" / "mae_gaussian_positions_0.01" /
                           "metrics.json").read_text())  # fmt: skip
    assert (settings["score"], settings["features"], settings["shrinkage"]) == ("gaussian", "positions", 0.01)

    # --rescore: scores kept before a method was added are scored again from the kept pretraining (the same
    # numbers, the pretraining's minutes, CPU and override kept); without it, or once rescored, the kept scores stand.
    older = {**result, "scoring": 1, "cpu": "an older CPU", "val": {"mae gone": 0.5}, "test": {"mae gone": 0.5}}
    (tmp_path / "keep" / "class3_seed0.json").write_text(json.dumps(older))
    assert anomaly.one_class(args, 3, 0, {}) == older
    args.rescore, args.override = True, {}  # the pretraining's override is the record's, whatever this call gives
    again = anomaly.one_class(args, 3, 0, {"train": (x, y), "test": (x, y)})
    assert again == {**result, "cpu": "an older CPU", "rescored on": again["rescored on"]}
    assert json.loads((tmp_path / "out" / "class3_seed0" / "study_scores.json").read_text()) == again
    assert anomaly.one_class(args, 3, 0, {}) == again  # rescored once: kept
    (tmp_path / "keep" / "class3_seed0.json").write_text(json.dumps(older))
    args.output = tmp_path / "elsewhere"
    with pytest.raises(SystemExit) as exit_:
        anomaly.one_class(args, 3, 0, {})
    message = str(exit_.value.code)
    assert message.startswith(f"--rescore: {args.output / 'class3_seed0'} holds no pretraining") and "\n" not in message


KEPT_RECIPE = {"model": {"embed_dim": 128, "depth": 6}, "data": {"crop_scale": [1.0, 1.0], "hflip": True},
               "optim": {"blr": 0.0015}, "loop": {"epochs": 30}}  # fmt: skip


def kept_run(mae_val: float, epochs: int, **edits: dict) -> dict:
    """A class and seed's scores as the anomaly study keeps them; `edits`: recipe sections' changed options."""
    aurocs = {"mae gaussian features @ 0.001": mae_val, "random-init gaussian features @ 0.001": 0.9, "pca error": 0.8}
    recipe = {section: {**options, **edits.get(section, {})} for section, options in KEPT_RECIPE.items()}
    recipe["loop"]["epochs"] = epochs
    return {"pretrain minutes": 9.0, "epochs": epochs, "recipe": recipe, "cpu": "a CPU", "val": aurocs, "test": aurocs}


def study(*args: str) -> subprocess.CompletedProcess:
    """`python -m studies.anomaly ARGS`, from the repository root as the docs run it."""
    return subprocess.run([sys.executable, "-m", "studies.anomaly", *args], capture_output=True, text=True, cwd=ROOT)


def kept_study(tmp_path: Path) -> Path:
    """A --keep folder holding every class and seed's scores (the MAE's Gaussian 0.94 + 0.002 x class)."""
    keep = tmp_path / "keep"
    keep.mkdir()
    for c in range(10):
        for seed in (0, 1):
            (keep / f"class{c}_seed{seed}.json").write_text(json.dumps(kept_run(0.94 + 0.002 * c, 30)))
    return keep


def run_kept(tmp_path: Path, *classes: int, seeds: tuple = (0,)) -> subprocess.CompletedProcess:
    """The study over `classes` and `seeds` with --keep TMP/keep, no data at all (the data folder is not there)."""
    args = ["--data", str(tmp_path / "no_data"), "--output", str(tmp_path / "out"), "--keep", str(tmp_path / "keep")]
    return study(*args, "--seeds", *map(str, seeds), "--classes", *map(str, classes))


def test_anomaly_study_completes_from_kept_scores(tmp_path):
    """--keep: classes and seeds kept there are not run again (no data, no pretraining); a run over all 10 classes
    and both seeds writes the study's results.json beside them, a run over some classes or one seed only into
    --output; once written, results.json alone keeps the runs; --table prints docs/results/anomaly.md's table of it."""
    keep = kept_study(tmp_path)

    def run(*classes: int, seeds: tuple = (0,)) -> subprocess.CompletedProcess:
        return run_kept(tmp_path, *classes, seeds=seeds)

    newer = kept_run(0.94, 30)  # scored after a method was added: the summary keeps the methods every run has
    newer["test"]["mae gaussian masked features @ 0.001"] = 0.99  # (val and test: one dict)
    (keep / "class0_seed0.json").write_text(json.dumps(newer))
    proc = run(0, 1)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.json").exists() and not (keep / "results.json").exists()
    assert "left out of the summary: mae gaussian masked features @ 0.001" in proc.stderr
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
    table = study("--keep", str(keep), "--table")
    assert table.returncode == 0, table.stderr  # docs/results/anomaly.md's table: the MAE's score bold, 0.949 on seed 0
    rows = {r.split(" | ")[0]: r for r in table.stdout.splitlines()[2:]}
    assert set(rows) == {"| **MAE: Gaussian feature distance** (0.001)", "| random-init: Gaussian feature distance "
                         "(0.001)", "| raw pixels: PCA error"}  # fmt: skip
    assert rows["| raw pixels: PCA error"].endswith(" | 80.00 | 80.00 (80.00) |")
    assert " | 94.90 | 94.90 | **94.90** (94.90) |" in rows["| **MAE: Gaussian feature distance** (0.001)"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text('{"protocol": {}}')
    for folder in ("none", "bad"):  # no results.json; not a study's
        table = study("--output", str(tmp_path / folder), "--table")
        assert table.returncode == 2 and table.stderr.startswith("--table: ") and table.stderr.count("\n") == 1

    for c in range(10):  # the per-class files gone (docs/results keeps results.json only): it alone keeps the runs
        for seed in (0, 1):
            (keep / f"class{c}_seed{seed}.json").unlink()
    proc = run(*range(10), seeds=(0, 1))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((keep / "results.json").read_text()) == report


def test_anomaly_study_refuses_kept_runs_of_another_protocol(tmp_path):
    """Kept runs of different lengths or recipes are never summarised together: one line naming the folder; a kept
    file cut short, or an --override that is not a JSON object, is one line too."""
    keep = kept_study(tmp_path)

    def run(*classes: int) -> subprocess.CompletedProcess:
        return run_kept(tmp_path, *classes)

    (keep / "class1_seed0.json").write_text(json.dumps(kept_run(0.96, 40)))  # the class's own file comes first
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
    for bad in ("[1]", "{depth: 4}"):
        proc = study("--override", bad)
        assert proc.returncode == 2 and proc.stderr.startswith("--override") and proc.stderr.count("\n") == 1

    (keep / "class1_seed0.json").write_text('{"val": ')  # cut short: one line naming the file, nothing run
    proc = run(1)
    assert proc.returncode == 1 and proc.stderr.startswith(f"{keep / 'class1_seed0.json'}: not a class's kept scores")
    assert proc.stderr.count("\n") == 1


def test_anomaly_study_resumes_from_its_run_folders(tmp_path):
    """Without --keep (the default), the run folders' own scores resume the study, and the refusal names them."""
    for c, epochs in ((0, 30), (1, 40)):
        (tmp_path / "out" / f"class{c}_seed0").mkdir(parents=True)
        (tmp_path / "out" / f"class{c}_seed0" / "study_scores.json").write_text(json.dumps(kept_run(0.95, epochs)))
    common = ["--data", str(tmp_path / "no_data"), "--output", str(tmp_path / "out"), "--seeds", "0", "--classes"]
    proc = study(*common, "0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["protocol"]["classes"] == [0]
    proc = study(*common, "0", "1")
    assert proc.returncode == 1 and proc.stderr.startswith(f"--output {tmp_path / 'out'}:")
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
    """studies/continued.py --budgets: only the budgets asked for are pretrained; another one is reported
    (without running anything new) once both its runs have finished; the table marks what is missing."""
    ran: list[str] = []

    def pretrain(run, data, seed, change=None):
        if not harness.finished(run):
            ran.append(run.name)
        return 60.0

    monkeypatch.setattr(continued, "pretrain", pretrain)
    probe = {"linprobe": 90.0, "knn": 80.0}  # continued runs 4 probe points above the rest: the goal is met
    monkeypatch.setattr(continued, "scores", lambda run, *a: {**probe, "linprobe": 94.0}
                        if run.name.startswith("continue_") else probe)  # fmt: skip
    out = tmp_path / "seed0"
    out.mkdir()
    for budget in finished:
        for source, target in continued.PAIRS:
            for run in (f"pretrain_{target}_{budget}", f"continue_{source}_to_{target}_{budget}"):
                harness.seconds_file(out / run).write_text("60")
    args = argparse.Namespace(out=str(tmp_path), fashion_mnist="fm", mnist="mn", budgets=budgets)
    result = continued.run_seed(args, 0)

    pairs = continued.PAIRS
    fresh = [f"{name}_{b}" for b in pretrained if b not in finished
             for s, t in pairs for name in (f"pretrain_{t}", f"continue_{s}_to_{t}")]  # fmt: skip
    assert sorted(ran) == sorted(["pretrain_fashion_mnist", "pretrain_mnist", *fresh])
    for s, t in continued.PAIRS:
        assert {k for k in result[f"{s}_to_{t}"] if k.startswith("continue_")} == {f"continue_{b}" for b in reported}

    other = {**result, "seed": 1}
    other["fashion_mnist_to_mnist"] = {k: v for k, v in result["fashion_mnist_to_mnist"].items() if "_1ep" not in k}
    table = continued.table([result, other], "cpu")
    header = next(line for line in table.splitlines() if line.startswith("| source"))
    assert header.count("continued, ") == len(reported)
    rows = [line for line in table.splitlines() if line.startswith("| Fashion-MNIST") or line.startswith("| MNIST")]
    assert len(rows) == 4 and all(line.count("|") == header.count("|") for line in rows)
    assert ("- |" in rows[1]) == ("1ep" in reported)  # seed 1 has no one-epoch runs for this pair
    goal = {"1ep": "at 1 epoch, in all 3 rows measured: yes.", "third": "at a third, in all 4 rows measured: yes."}
    assert [b for b in goal if goal[b] in table] == reported


def test_continued_pretraining_is_the_continue_recipe_over_the_scratch_recipe():
    """The continued runs' overrides: recipes/pretrain/continue.yaml's sections, the budget's epochs and the source
    as `init` (the two recipe files that `mae pretrain --config A --config B` would stack)."""
    change = continued.continued("third", Path("runs/source"))
    recipe = yaml.safe_load(continued.CONTINUE.read_text())
    assert change["init"] == "runs/source" and change["loop"]["epochs"] == 5
    assert change["optim"] == recipe["optim"] and change["loop"]["min_steps"] == recipe["loop"]["min_steps"]


def test_anomaly_layers_reads_the_tokens_mae_anomaly_scores_last():
    """The layer study's last tokens are the encoder's output without prefix tokens (what `mae anomaly` scores), its
    first the patch embedding's with positions, one entry per block between, whatever the batch."""
    from studies.anomaly_layers import layer_tokens

    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
    x = torch.randn(5, 3, 32, 32)
    layers = layer_tokens(model, x, batch=2)
    enc = model.encoder
    assert len(layers) == len(enc.blocks) + 2 and all(t.shape == (5, 16, 96) for t in layers)
    with torch.no_grad():
        torch.testing.assert_close(layers[-1], enc.forward_features(x)[:, enc.num_prefix_tokens :])
        embedded = enc.patch_embed(x) + enc.pos_embed[:, enc.num_prefix_tokens :]
    torch.testing.assert_close(layers[0], embedded)


def test_the_colour_defect_study_scores_each_defect_kind_against_the_normal_images_alone():
    """Per defect kind, the other kinds' images take no part: a kind ranked above every normal image is 1.0 however
    the others rank, one ranked below every normal image 0.0."""
    from studies.anomaly_rgb import by_defect, kinds_of

    kinds = kinds_of(["test/good/0.png", "test/good/1.png", "test/blotch/0.png", "test/scratch/0.png",
                      "test/scratch/1.png", "test/cut_paste/0.png"])  # fmt: skip
    assert kinds.tolist() == ["good", "good", "blotch", "scratch", "scratch", "cut_paste"]
    scores = np.array([0.5, 0.6, 0.9, 0.1, 0.2, 0.55])
    assert by_defect(scores, kinds) == {"blotch": 1.0, "cut_paste": 0.5, "scratch": 0.0}
