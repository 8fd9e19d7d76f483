import json
import os
import stat

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed

import mae
from mae.cli import main
from mae.weights.importers import CheckpointError
from mae.weights.record import read_spec

SMALL = dict(img_size=32, patch_size=8, depth=2, decoder_depth=1)


@pytest.mark.parametrize("name", mae.list_presets())
def test_export_loads_strictly_in_timm_with_same_features(tmp_path, name):
    model = mae.create_mae(name, **SMALL).eval()
    path = mae.export_encoder(model, tmp_path / "enc.safetensors")
    tensors = load_file(path)
    assert not any(k.startswith("decoder") or k == "mask_token" for k in tensors)
    assert all(t.is_contiguous() for t in tensors.values())
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    arch, args = meta["architecture"], json.loads(meta["model_args"])
    assert timm.is_model(arch) and args["global_pool"] == "token" and meta["mae_version"] == mae.__version__
    # no statistics recorded: the record's rule gives timm ImageNet's for 3 channels, and the record says "unknown"
    assert json.loads(meta["pretrained_cfg"])["mean"] == [0.485, 0.456, 0.406]
    assert read_spec(path) == model.spec and model.spec.mean is None
    # timm itself loads the file (strictly: load_pretrained raises on any missing or extra key)
    vit = timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=0),
                            num_classes=0, **args).eval()  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(x), model.encoder.forward_features(x))
    assert set(vit.state_dict()) == set(tensors)


def test_export_with_a_head_and_load_encoder_resample(tmp_path):
    model = mae.create_mae("mae_vit_micro_patch8").eval()
    path = mae.export_encoder(model, tmp_path / "enc.safetensors")
    clf = mae.load_encoder(path, num_classes=10)
    assert clf.head.out_features == 10
    enc = model.encoder.state_dict()
    for k, v in clf.state_dict().items():
        if not k.startswith("head"):
            assert torch.equal(v, enc[k]), k
    # at 48 px the only difference is timm's resampled position embedding
    big = mae.load_encoder(path, img_size=48).eval()
    assert big.pos_embed.shape[1] == 1 + 36
    expected = resample_abs_pos_embed(model.encoder.pos_embed, new_size=(6, 6), num_prefix_tokens=1)
    torch.testing.assert_close(big.pos_embed, expected)
    for k, v in big.state_dict().items():
        if k != "pos_embed":
            assert torch.equal(v, enc[k]), k


def test_hf_folder_is_what_timm_reads(tmp_path):
    model = mae.create_mae("mae_vit_micro_patch8").eval()
    folder = mae.export_encoder(model, tmp_path / "hub", format="hf-folder")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "README.md"}
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["pretrained_cfg"]["input_size"] == [3, 32, 32] and cfg["num_features"] == 96
    vit = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()  # the hf-hub layout, read locally
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(x), model.encoder.forward_features(x))
    assert mae.load_encoder(folder).embed_dim == 96


def test_timm_architecture_names_the_standard_models():
    assert mae.create_mae("mae_vit_base_patch16", depth=1).adapter.timm_architecture()[0] == "vit_base_patch16_224"
    assert mae.create_mae("mae_vit_huge_patch14", depth=1).adapter.timm_architecture()[0] == "vit_huge_patch14_224"


def test_cli_export_from_an_output_folder(tmp_path, capsys):
    from accelerate.state import AcceleratorState

    from tests.conftest import make_images

    make_images(tmp_path / "imgs", n=8)
    AcceleratorState._reset_state(True)
    assert main(["pretrain", "--data.path", str(tmp_path / "imgs"), "--model.name", "mae_vit_micro_patch8",
                 "--model.img_size", "32", "--loop.epochs", "1", "--loop.batch_size", "4", "--data.num_workers", "0",
                 "--loop.progress", "false", "--output_dir", str(tmp_path / "run")]) == 0  # fmt: skip
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "e.safetensors")]) == 0
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        config = json.loads(f.metadata()["config"])
    assert config["model"]["name"] == "mae_vit_micro_patch8"
    a, b = load_file(tmp_path / "e.safetensors"), load_file(tmp_path / "run" / "encoder.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "x")]) == 2
    assert "nope: no such file or folder" in capsys.readouterr().err


def test_load_encoder_rejects_other_files(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="x.safetensors: not a readable safetensors file"):
        mae.load_encoder(tmp_path / "x.safetensors")


def test_written_weights_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable by colleagues, as the rest of a run's files
