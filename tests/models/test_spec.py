"""The model record: one `ModelSpec`, written into every artifact that carries a model and read back the same."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mae
from mae.models.spec import SPEC_KEY, ModelSpec, spec_of, with_spec
from mae.weights.classifier import export_classifier
from mae.weights.export import save_model
from mae.weights.onnx import export_onnx
from mae.weights.record import read_spec
from tests.conftest import make_images, make_labeled


def test_the_model_is_built_from_its_record_and_gives_it_back():
    model = mae.create_mae("mae_vit_micro_patch8", img_size=(32, 48), mask_ratio=0.6, decoder="cross",
                           predict_ratio=0.5, mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.4))  # fmt: skip
    spec = model.spec
    assert spec.img_size == (32, 48) and spec.grid_size == (4, 6) and spec.decoder == "cross"
    assert (spec.embed_dim, spec.depth, spec.num_heads, spec.mlp_ratio) == (96, 3, 3, 4.0)  # the preset's, resolved
    again = mae.MaskedAutoencoder.from_spec(spec)
    assert again.spec == spec
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert ModelSpec.from_json(spec.to_json()) == spec == spec_of(json.loads(json.dumps(with_spec({}, spec))))


def test_statistics_have_one_rule():
    rgb, grey = ModelSpec(in_chans=3), ModelSpec(in_chans=1)
    assert rgb.input_stats() == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # unrecorded RGB: ImageNet's
    assert grey.input_stats() is None  # unrecorded otherwise: unknown, the stage asks for them
    assert grey.with_stats((0.5,), (0.2,)).input_stats() == ((0.5,), (0.2,))


def test_a_newer_record_reads_with_a_warning_and_a_damaged_one_fails(tmp_path):
    with pytest.warns(UserWarning, match="does not know"):
        assert ModelSpec.from_dict({**ModelSpec().to_dict(), "future_flag": 1}) == ModelSpec()
    bad = tmp_path / "bad.safetensors"
    model = mae.create_mae("mae_vit_micro_patch8")
    save_model(model, bad)
    from safetensors.torch import load_file, save_file

    save_file(load_file(bad), str(bad), metadata={"format": "pt", SPEC_KEY: '{"depth": "three", "img_size": 5'})
    with pytest.raises(mae.CheckpointError, match="model record"):
        mae.load_pretrained(bad)


@pytest.mark.slow
def test_every_artifact_carries_the_same_record(tmp_path):
    make_images(tmp_path / "imgs", n=16)
    labeled = make_labeled(tmp_path / "labeled", per_class=8)
    loop = {"batch_size": 8, "epochs": 1, "progress": False}
    run = mae.pretrain(
        data={"path": tmp_path / "imgs", "mean": "auto", "std": "auto", "num_workers": 0},
        model={"name": "mae_vit_micro_patch8", "img_size": 32, "mask_ratio": 0.6, "decoder_depth": 2},
        loop=loop,
        optim={"warmup_epochs": 0.5},
        output_dir=tmp_path / "run",
    ).output_dir
    spec = read_spec(run)
    assert spec.mask_ratio == 0.6 and spec.decoder_depth == 2 and spec.img_size == (32, 32)
    assert spec.mean != (0.485, 0.456, 0.406) and len(spec.mean) == 3  # measured on the data, recorded
    assert mae.load_pretrained(run).spec == spec
    assert read_spec(run / "encoder.safetensors") == spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an encoder-only file: its decoder starts fresh, of the recorded size
        alone = mae.export_encoder(run, tmp_path / "alone.safetensors")
        assert read_spec(alone) == spec and mae.load_pretrained(alone).spec == spec
    both = mae.export_encoder(run, tmp_path / "both.safetensors", with_decoder=True)
    assert read_spec(both) == spec == read_spec(tmp_path / "both.decoder.safetensors")
    assert mae.load_pretrained(both).spec == spec
    hf = mae.export_encoder(run, tmp_path / "hf", format="hf-folder")
    assert read_spec(hf) == spec == spec_of(json.loads((hf / "config.json").read_text()))
    whole = save_model(mae.load_pretrained(run), tmp_path / "whole.safetensors")  # what `mae convert` writes
    assert read_spec(whole) == spec and mae.load_pretrained(whole).spec == spec
    assert read_spec(export_onnx(run, tmp_path / "enc.onnx")) == spec

    probe = mae.linprobe(pretrained=run, data={"path": labeled, "num_workers": 0}, loop=loop,
                         output_dir=tmp_path / "probe")  # fmt: skip
    assert read_spec(probe.export) == spec  # the classifier's encoder, at its own size and statistics
    assert read_spec(export_classifier(probe.output_dir, tmp_path / "clf_hf", format="hf-folder")) == spec
    assert read_spec(export_onnx(probe.output_dir, tmp_path / "clf.onnx")) == spec
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a classifier read as an encoder: head dropped, said in a warning
        assert mae.load_pretrained(probe.export).spec == spec


_TOY_SPEC = ("    std: tuple[float, ...] | None = None\n", "    toy_gain: float = 1.0  # a test's new model option\n")
_TOY_ARG = ("        std: tuple[float, ...] | None = None,\n    ) -> None:", "        toy_gain: float = 1.0,\n")
_TOY_RUN = """
import warnings, mae
from mae.weights.export import save_model
model = mae.create_mae("mae_vit_micro_patch8", toy_gain=2.5)
save_model(model, "init.safetensors")
run = mae.pretrain(init="init.safetensors", data={"path": "imgs", "num_workers": 0}, output_dir="run",
                   loop={"batch_size": 8, "epochs": 1, "progress": False}, optim={"warmup_epochs": 0.5})
mae.export_encoder(run.output_dir, "export.safetensors", with_decoder=True)
print("TOY", mae.load_pretrained("export.safetensors").spec.toy_gain)
"""


def _insert(text: str, anchor: str, addition: str, before: bool = False) -> str:
    assert text.count(anchor) == 1, f"the anchor moved: {anchor!r}"
    return text.replace(anchor, addition + anchor if before else anchor + addition)


@pytest.mark.slow
def test_a_new_model_option_travels_by_editing_the_model_and_the_spec_only(tmp_path):
    """A copy of the package where only models/spec.py and models/mae.py know a new option: it goes from the model
    through pretraining (--init), the run's export and load_pretrained, with no other file edited."""
    package = tmp_path / "src" / "mae"
    shutil.copytree(Path(mae.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    spec_py, mae_py = package / "models" / "spec.py", package / "models" / "mae.py"
    spec_py.write_text(_insert(spec_py.read_text(), *_TOY_SPEC))
    mae_py.write_text(_insert(mae_py.read_text(), *_TOY_ARG, before=True))  # a keyword argument, recorded as it is
    make_images(tmp_path / "imgs", n=8)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    done = subprocess.run([sys.executable, "-c", _TOY_RUN], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TOY 2.5" in done.stdout
    assert dataclasses.fields(ModelSpec)  # the package under test itself is untouched
    assert "toy_gain" not in ModelSpec.__dataclass_fields__


def test_a_stage_asks_for_the_statistics_a_foreign_file_never_recorded(tmp_path, capsys):
    """The rule's other side, where a stage meets it: a 1-channel encoder from another toolkit (a timm state dict, no
    record) has no default normalisation, so k-NN and the attention maps stop with one line asking for it."""
    import torch

    model = mae.create_mae("mae_vit_micro_patch8", in_chans=1)
    torch.save(model.encoder.state_dict(), tmp_path / "grey.pth")  # timm's keys, no metadata
    labeled = make_labeled(tmp_path / "labeled", per_class=2)
    with pytest.raises(mae.ConfigError, match=r"^--data\.mean / --data\.std: .*grey\.pth records no normalisation "
                                              r"for its 1 channels; give them"):  # fmt: skip
        mae.knn(pretrained=tmp_path / "grey.pth", data={"path": labeled}, output_dir=tmp_path / "knn")
    from mae.cli import main

    image = next((labeled / "red").iterdir())
    args = ["visualize", "--attention", "--pretrained", str(tmp_path / "grey.pth"), "--images", str(image)]
    capsys.readouterr()
    assert main([*args, "--output", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records no normalisation for its channels" in err, err
    assert not (tmp_path / "a.png").exists()
