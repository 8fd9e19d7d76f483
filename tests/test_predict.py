"""`mae predict`: top-k classes of a trained classifier, from files or any source, as CSV or JSON."""

import csv
import json
from pathlib import Path

import pytest

import mae
from mae.cli import main
from mae.data.open import open_source
from tests.conftest import make_labeled


@pytest.mark.slow
def test_predict_reproduces_the_fine_tune_evaluation_image_by_image(tmp_path, capsys, evaluations):
    make_labeled(tmp_path / "train", per_class=8)
    make_labeled(tmp_path / "val", per_class=6, seed=1)
    run = mae.finetune(pretrained="random:mae_vit_micro_patch8", output_dir=str(tmp_path / "ft"), seed=0,
                       data={"path": str(tmp_path / "train"), "val_path": str(tmp_path / "val"), "num_workers": 0},
                       loop={"epochs": 2, "batch_size": 8, "mixed_precision": "no", "compile": False,
                             "progress": False, "log_with": "none"},
                       aug={"mixup": 0.0, "cutmix": 0.0})  # fmt: skip
    logged = [json.loads(line) for line in (tmp_path / "ft/metrics.jsonl").read_text().splitlines()]
    top1 = [r for r in logged if r.get("eval") == "val"][-1]["top1"]
    out = tmp_path / "pred.csv"
    argv = ["predict", "--pretrained", str(run.output_dir), "--data.path", str(tmp_path / "val"),
            "--output", str(out), "--loop.batch_size", "5", "--top_k", "2", "--data.num_workers", "0"]  # fmt: skip
    assert main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 18 and list(rows[0])[:5] == ["file", "class", "probability", "class_2", "probability_2"]
    assert all(Path(r["file"]).is_file() and Path(r["file"]).parent.parent == tmp_path / "val" for r in rows)
    correct = sum(Path(r["file"]).parent.name == r["class"] for r in rows)
    assert 100.0 * correct / len(rows) == pytest.approx(top1, abs=1e-9)
    # Image by image, as the stage's last evaluation scored it (its pass runs in the labeled source's order).
    logits, labels = evaluations[-1]
    val, classes = open_source(str(tmp_path / "val"), labeled=True), ["blue", "green", "red"]
    probs, by_file = logits.softmax(1), {r["file"]: r for r in rows}
    assert len(by_file) == len(val) == len(labels) == 18
    for i in range(len(val)):
        row = by_file[val.name(i)]
        assert classes[int(labels[i])] == Path(val.name(i)).parent.name  # the record is in this order
        assert row["class"] == classes[int(probs[i].argmax())], val.name(i)
        assert float(row["probability"]) == pytest.approx(probs[i].max().item(), abs=1e-5), val.name(i)


@pytest.fixture
def classifier(tmp_path):
    from tests.test_deploy_weights import _classifier_run

    _classifier_run(tmp_path / "run")
    return tmp_path / "run"


def test_predict_files_to_json_and_csv(tmp_path, classifier, capsys):
    make_labeled(tmp_path / "imgs", per_class=2)
    files = sorted(str(p) for p in (tmp_path / "imgs").rglob("*.png"))
    assert main(["predict", "--pretrained", str(classifier), "--images", *files, "--output", str(tmp_path / "p.json"),
                 "--top_k", "9", "--data.num_workers", "0"]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [r["file"] for r in rows] == files
    for r in rows:
        probs = [t["probability"] for t in r["top_k"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1, abs=1e-5)
        assert r["class"] == r["top_k"][0]["class"] and r["probability"] == probs[0]
    # the same images through the Python API and a folder in --images, printed
    result = mae.predict(pretrained=str(classifier), images=[str(tmp_path / "imgs")], data={"num_workers": 0})
    assert result.metrics["images"] == 6
    printed = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()[-6:]]
    assert [line[1] for line in printed] == [r["class"] for r in rows]
    # printed, as written: each of the top-k classes (--top_k 2 of 3) with its probability after the file
    assert main(["predict", "--pretrained", str(classifier), "--images", files[0], "--top_k", "2",
                 "--data.num_workers", "0"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1].split("\t")
    assert len(line) == 5 and line[0] == files[0] and [line[1], line[3]] == [t["class"] for t in rows[0]["top_k"][:2]]


def test_an_encoder_export_given_to_predict_is_one_line(tmp_path, capsys):
    mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    make_labeled(tmp_path / "imgs", per_class=1)
    assert (
        main(["predict", "--pretrained", str(tmp_path / "enc.safetensors"), "--data.path", str(tmp_path / "imgs")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pretrained" in err and "no classifier head" in err


@pytest.mark.parametrize(
    "extra, words",
    [
        ([], "give exactly one"),
        (["--images", "nope.png"], "no such file"),
        (["--data.path", "X", "--output", "p.txt"], ".csv or a .json"),
    ],
)
def test_bad_predict_options_are_one_line(tmp_path, classifier, capsys, extra, words):
    assert main(["predict", "--pretrained", str(classifier), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err
