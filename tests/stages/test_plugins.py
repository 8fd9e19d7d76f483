"""Extensions registered from outside the package reach the stages: a data-source kind (images in a zip file)
that `mae pretrain` and `mae knn` read, and a decoder that `mae pretrain` trains and `mae export` exports."""

import json
import zipfile

import pytest
import torch
from accelerate.state import AcceleratorState

import mae
from mae.cli import main
from mae.data.open import register_source, unregister_source
from tests.conftest import make_images, make_labeled
from tests.data.test_open import ZipKind
from tests.models.test_extension import LinearDecoder  # noqa: F401 - registers the "toy" decoder


def cli(*args) -> int:
    AcceleratorState._reset_state(True)
    return main([str(a) for a in args])


def zip_folder(folder, path):
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(folder.rglob("*.*")):
            zf.write(f, f.relative_to(folder).as_posix())
    return path


@pytest.fixture
def zip_kind():
    register_source(ZipKind)
    yield
    unregister_source("zip")


@pytest.mark.slow
def test_a_zip_source_kind_is_read_by_pretrain_and_knn(zip_kind, tmp_path, capsys):
    make_images(tmp_path / "imgs", n=12, nested=False)
    photos = zip_folder(tmp_path / "imgs", tmp_path / "photos.zip")
    labeled = zip_folder(make_labeled(tmp_path / "labeled", per_class=8), tmp_path / "labeled.zip")
    small = ["--model.img_size", 32, "--loop.epochs", 1, "--loop.batch_size", 4, "--loop.progress", "false"]
    assert cli("pretrain", "--data.path", photos, "--model.name", "mae_vit_micro_patch8", *small,
               "--optim.warmup_epochs", 0, "--output_dir", tmp_path / "pre") == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "on 12 images (" in out and str(photos) in out
    assert cli("knn", "--pretrained", tmp_path / "pre", "--data.path", labeled, "--loop.batch_size", 4,
               "--data.val_fraction", 0.25, "--output_dir", tmp_path / "knn") == 0  # fmt: skip
    result = json.loads((tmp_path / "knn" / "metrics.jsonl").read_text().splitlines()[-1])
    assert result["samples"] == 6 and result["eval"] == "knn"


@pytest.mark.slow
def test_an_outside_decoder_is_trained_by_pretrain_and_exported(tmp_path):
    make_images(tmp_path / "imgs", n=8)
    assert cli("pretrain", "--data.path", tmp_path / "imgs", "--model.name", "mae_vit_micro_patch8",
               "--model.decoder", "toy", "--model.img_size", 32, "--loop.epochs", 2, "--loop.batch_size", 4,
               "--optim.warmup_epochs", 0, "--output_dir", tmp_path / "pre") == 0  # fmt: skip
    losses = [m["loss"] for m in map(json.loads, (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines())
              if "eval" not in m]  # fmt: skip
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert cli("export", "--checkpoint", tmp_path / "pre", "--output", tmp_path / "enc.safetensors") == 0
    exported, trained = mae.load_encoder(tmp_path / "enc.safetensors"), mae.load_encoder(tmp_path / "pre")
    assert exported.embed_dim == 96 and len(exported.blocks) == 3  # timm loads it, strictly
    a, b = exported.state_dict(), trained.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cli("pretrain", "--model.decoder", "nope", "--data.path", tmp_path / "imgs") == 2
