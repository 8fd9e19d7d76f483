"""The Python API: the stages as functions, in one process (no reset of Accelerate's state between them),
validated as the command line validates them."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from PIL import Image

import mae
import mae.cli
from mae.stages.options import build
from mae.train.optim import Schedule
from tests.conftest import held_out, last_eval, make_images, make_labeled

TINY = {"model": {"name": "mae_vit_micro_patch8", "img_size": 32}, "optim": {"warmup_epochs": 0}}


@pytest.mark.slow
def test_pretrain_knn_finetune_then_classify_one_image_in_one_process(tmp_path, evaluations):
    make_images(tmp_path / "imgs", n=16)
    labeled = make_labeled(tmp_path / "labeled", per_class=12)
    small = {"batch_size": 8, "epochs": 1, "progress": False, "mixed_precision": "no"}
    pre = mae.pretrain(
        data={"path": tmp_path / "imgs"},
        model={"name": "mae_vit_micro_patch8", "img_size": 32},
        loop=small,
        optim={"warmup_epochs": 0.5},
        output_dir=tmp_path / "pre",
    )
    assert pre.output_dir == tmp_path / "pre" and pre.export == tmp_path / "pre" / "encoder.safetensors"
    assert pre.export.is_file() and pre.metrics["eval"] == "preview"

    knn = mae.knn(pretrained=pre.output_dir, data={"path": labeled}, loop={"batch_size": 8},
                  output_dir=tmp_path / "knn")  # fmt: skip
    assert knn.export is None and knn.metrics["samples"] == 4
    assert {k: knn.metrics[k] for k in ("eval", "top1")} == {k: last_eval(knn.output_dir)[k] for k in ("eval", "top1")}

    ft = mae.finetune(
        pretrained=pre.export,
        data={"path": labeled},
        loop={**small, "epochs": 2},
        optim={"warmup_epochs": 0.5},
        aug={"mixup": 0, "cutmix": 0},
        output_dir=tmp_path / "ft",
    )
    assert ft.export == tmp_path / "ft" / "classifier.safetensors" and ft.metrics["eval"] == "val"
    same = {"loop": {**small, "epochs": 2}, "optim": {"warmup_epochs": 0.5}, "aug": {"mixup": 0, "cutmix": 0}}
    again = mae.finetune(pretrained=pre.export, data={"path": labeled}, output_dir=tmp_path / "ft", **same)
    assert again.metrics == ft.metrics  # resumed at its end: nothing to train, the run's last evaluation

    clf = mae.load_classifier(ft.output_dir)
    assert clf.classes == ["blue", "green", "red"]
    files, labels = held_out(labeled)  # the fine-tune evaluated these, in this order
    image = Image.open(files[0]).convert("RGB")
    with torch.no_grad():
        probs = clf.model(clf.transform(image)[None]).softmax(-1)[0]
    logits, logged_labels = evaluations[-1]
    assert logged_labels.tolist() == labels  # the trained head and the eval transform: the image's logged output
    torch.testing.assert_close(probs, logits[0].softmax(-1), atol=1e-5, rtol=1e-4)


def test_a_bad_option_raises_the_typed_error_with_the_cli_message(tmp_path, capsys):
    with pytest.raises(mae.ConfigError) as api:
        mae.pretrain(loop={"epochs": 0}, output_dir=tmp_path / "x")
    assert mae.cli.main(["pretrain", "--loop.epochs", "0", "--output_dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == f"mae pretrain: error: {api.value}"
    assert str(api.value) == "--loop.epochs 0: must be >= 1"
    with pytest.raises(mae.ConfigError, match="no_such_key"):
        mae.pretrain(loop={"no_such_key": 1})
    with pytest.raises(mae.MaeError, match="--pretrained: required"):
        mae.linprobe(data={"path": tmp_path}, output_dir=tmp_path / "p")
    with pytest.raises(mae.ConfigError, match="no such recipe file"):
        mae.finetune(tmp_path / "missing.yaml")


def test_a_recipe_and_a_config_object_are_read_as_the_command_line_reads_them(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loop:\n  epochs: 0\n")  # a recipe's bad value is refused like the command line's
    with pytest.raises(mae.ConfigError, match=r"--loop.epochs 0: must be >= 1"):
        mae.pretrain(recipe)
    from mae.config import PretrainConfig

    with pytest.raises(mae.ConfigError, match=r"--seed -1: must be >= 0"):
        mae.pretrain(PretrainConfig(), seed=-1)


def test_a_bad_option_fails_as_a_recipe_or_the_command_line_fails(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loop:\n  no_such_key: 1\n")
    with pytest.raises(mae.ConfigError) as api:
        mae.pretrain(loop={"no_such_key": 1})
    assert mae.cli.main(["pretrain", "--config", str(recipe)]) == 2
    assert capsys.readouterr().err.strip() == f"mae pretrain: error: {api.value}"
    assert str(api.value) == "Group 'loop' does not accept option 'no_such_key'"
    with pytest.raises(mae.ConfigError) as api:
        mae.pretrain(loop={"epochs": "many"})
    assert mae.cli.main(["pretrain", "--loop.epochs", "many"]) == 2
    assert capsys.readouterr().err.strip() == f"mae pretrain: error: {api.value}"
    assert "loop.epochs" in str(api.value) and "\n" not in str(api.value)


def test_overrides_merge_over_the_recipe_section_by_section_and_a_config_object_round_trips(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loop:\n  epochs: 7\n  batch_size: 3\noptim:\n  blr: 1.5e-3\n")
    cfg = build("pretrain", recipe, {"loop": {"epochs": 2}, "data": {"path": tmp_path}, "seed": 4})
    assert (cfg.loop.epochs, cfg.loop.batch_size, cfg.optim.blr, cfg.seed) == (2, 3, 1.5e-3, 4)
    assert cfg.data.path == str(tmp_path)  # a Path is a path option's string, as on the command line
    assert build("pretrain", cfg) == cfg and build("pretrain", cfg, {"loop": cfg.loop}) == cfg
    with pytest.raises(mae.ConfigError, match=r"^config: expected a recipe path or a PretrainConfig, got KnnConfig$"):
        build("pretrain", build("knn", None, {"pretrained": "x"}))


def test_the_api_sits_below_the_command_line():
    code = "import sys, mae, mae.api; from mae import pretrain; assert 'mae.cli' not in sys.modules, 'mae.cli'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_registered_stage_is_a_function_of_the_package():
    assert set(mae.list_stages()) <= set(dir(mae)) and set(mae.list_stages()) <= set(mae.__all__)
    from mae import knn, pretrain

    assert pretrain is mae.pretrain and knn.__name__ == "knn" and "mae knn --help" in knn.__doc__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_stage'"):
        mae.no_such_stage  # noqa: B018


def test_data_may_be_a_datasets_dataset_object(tmp_path):
    import datasets

    images = [Image.new("RGB", (32, 32), (i * 30 % 255, 80, 160)) for i in range(8)]
    ds = datasets.Dataset.from_dict({"image": images})
    assert build("pretrain", None, {"data": {"path": ds}}).data.path is ds  # the object itself, not a token
    loop = {"epochs": 1, "batch_size": 4, "progress": False}
    result = mae.pretrain(data={"path": ds}, output_dir=tmp_path / "pre", loop=loop, **TINY)
    assert result.export.is_file() and result.metrics["eval"] == "preview"
    saved = yaml.safe_load((tmp_path / "pre" / "config.yaml").read_text())["data"]["path"]
    assert saved == f"datasets.Dataset(fingerprint={ds._fingerprint}, num_rows=8)"  # what YAML can say of it

    again = mae.pretrain(data={"path": ds}, output_dir=tmp_path / "pre", loop=loop, **TINY)
    assert again.metrics == result.metrics  # the same dataset: resumed at its end, nothing left to train
    other = datasets.Dataset.from_dict({"image": images[:6]})
    with pytest.raises(mae.ConfigError, match=r"trained with a different config \(data.path: "):
        mae.pretrain(data={"path": other}, output_dir=tmp_path / "pre", loop=loop, **TINY)
    with pytest.raises(mae.DataError, match="recorded by its fingerprint only; hand the object again"):
        mae.pretrain(data={"path": saved}, output_dir=tmp_path / "x", loop=loop, **TINY)


def test_labeled_datasets_objects_as_train_and_val_data_of_a_downstream_stage(tmp_path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])})
    images = [Image.new("RGB", (32, 32), (v, v, v)) for v in (10, 20, 30, 220, 230, 240)]
    train = datasets.Dataset.from_dict({"image": images, "label": [0, 0, 0, 1, 1, 1]}, features=features)
    val = datasets.Dataset.from_dict({"image": images[::3], "label": [0, 1]}, features=features)
    knn = mae.knn(pretrained="random:mae_vit_micro_patch8", data={"path": train, "val_path": val, "num_workers": 0},
                  model={"img_size": 32}, loop={"batch_size": 4}, output_dir=tmp_path / "knn")  # fmt: skip
    assert knn.metrics["samples"] == 2  # the val dataset, not a tenth of the train one
    saved = yaml.safe_load((tmp_path / "knn" / "config.yaml").read_text())["data"]
    assert saved["path"].endswith("num_rows=6)") and saved["val_path"].endswith("num_rows=2)")
    cached = {
        "pretrained": "random:mae_vit_micro_patch8",
        "model": {"img_size": 32},
        "cache_dir": tmp_path / "cache",
        "data": {"path": train, "val_path": val, "num_workers": 0},
        "loop": {"batch_size": 4, "epochs": 1},
    }
    probe = mae.linprobe(output_dir=tmp_path / "probe", **cached)  # the cache records the datasets by fingerprint
    record = json.loads((tmp_path / "cache" / "cache.json").read_text())
    assert record["data"]["train"]["path"] == saved["path"] and probe.metrics["samples"] == 2
    with pytest.raises(mae.ConfigError, match=r"^--images: a datasets.Dataset object goes where one data path goes"):
        mae.predict(pretrained=tmp_path, images=[val])


def test_two_stages_with_different_precisions_run_in_one_process(tmp_path):
    make_images(tmp_path / "imgs", n=8)
    for precision in ("no", "bf16", "no"):
        result = mae.pretrain(data={"path": tmp_path / "imgs", "num_workers": 0}, output_dir=tmp_path / precision,
                              loop={"epochs": 1, "batch_size": 4, "progress": False, "mixed_precision": precision},
                              resume="never", **TINY)  # fmt: skip
        saved = yaml.safe_load((tmp_path / precision / "config.yaml").read_text())
        assert result.export.is_file() and saved["loop"]["mixed_precision"] == precision


def test_min_steps_keeps_the_warm_up_its_share_of_the_run(tmp_path):
    """warmup_epochs 1 of epochs 2 is half the run; min_steps 8 at 2 steps an epoch grows it to 4 epochs, and the
    warm-up to 4 of its 8 steps (not 2)."""
    labeled = make_labeled(tmp_path / "labeled", per_class=4)  # 10 train images, batch 5: 2 steps an epoch
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    mae.finetune(pretrained=enc, data={"path": labeled, "num_workers": 0}, aug={"mixup": 0, "cutmix": 0},
                 optim={"warmup_epochs": 1, "lr": 1e-3, "min_lr": 0}, model={"head_init": "random"},
                 loop={"epochs": 2, "batch_size": 5, "min_steps": 8, "log_every": 1, "progress": False},
                 output_dir=tmp_path / "ft")  # fmt: skip
    logged = [
        m["lr"] for m in map(json.loads, (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()) if "lr" in m
    ]
    expected = Schedule(base_lr=1e-3, min_lr=0, warmup_steps=4, total_steps=8)
    assert logged == pytest.approx([expected.lr(step) for step in range(8)])


def test_min_steps_grows_the_epochs_and_head_init_random_skips_the_probe(tmp_path):
    labeled = make_labeled(tmp_path / "labeled", per_class=4)  # 12 images: 10 train, batch 5: 2 steps an epoch
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    common = {"pretrained": enc, "data": {"path": labeled, "num_workers": 0}, "aug": {"mixup": 0, "cutmix": 0},
              "optim": {"warmup_epochs": 0}}  # fmt: skip
    ft = mae.finetune(loop={"epochs": 1, "batch_size": 5, "min_steps": 5, "progress": False}, output_dir=tmp_path / "a",
                      model={"head_init": "random"}, **common)  # fmt: skip
    lines = [json.loads(s) for s in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in lines) == 6 and ft.metrics["eval"] == "val"  # ceil(5 / 2) = 3 epochs of 2 steps
    assert not [m for m in lines if m.get("eval") == "probe_init"]  # the paper's head: no starting probe
    mae.finetune(loop={"epochs": 1, "batch_size": 5, "progress": False}, output_dir=tmp_path / "b", **common)
    lines = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["eval"] == "probe_init" and max(m["step"] for m in lines) == 2  # min_steps 0: epochs alone
