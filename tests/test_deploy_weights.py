"""Weights out for deployment: the decoder beside an encoder export (read back exactly), hf folders of classifiers
(timm loads them with their labels), the model card, and the push to the Hub (against a stand-in: no network)."""

import json
import shutil
import warnings

import pytest
import torch

import mae
from mae.cli import main
from mae.models.classifier import build_classifier
from mae.weights.classifier import export_classifier, save_classifier
from mae.weights.importers import read_encoder


def _assert_same_mae(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    x = torch.randn(2, a.in_chans, *a.img_size)
    noise = torch.rand(2, a.num_patches if hasattr(a, "num_patches") else a.grid_size[0] * a.grid_size[1])
    with torch.no_grad():
        assert torch.equal(a(x, noise=noise).loss, b(x, noise=noise).loss)


@pytest.mark.parametrize("fmt", ["safetensors", "hf-folder"])
def test_the_decoder_beside_an_export_is_read_back_exactly(tmp_path, fmt):
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", mask_ratio=0.6, norm_pix_loss=False).eval()
    out = mae.export_encoder(model, tmp_path / ("enc.safetensors" if fmt == "safetensors" else "hub"), fmt,
                             with_decoder=True)  # fmt: skip
    decoder = tmp_path / ("enc.decoder.safetensors" if fmt == "safetensors" else "hub/decoder.safetensors")
    assert decoder.is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "freshly initialised" warning
        back = mae.load_pretrained(out).eval()
    assert back.mask_ratio == 0.6 and back.norm_pix_loss is False
    _assert_same_mae(model, back)
    # timm and load_encoder still read the encoder file alone, strictly
    import timm

    weights = out if fmt == "safetensors" else out / "model.safetensors"
    arch, args = model.adapter.timm_architecture()
    vit = timm.create_model(arch, pretrained=True, pretrained_cfg_overlay={"file": str(weights)}, num_classes=0,
                            **args).eval()  # fmt: skip
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vit.forward_features(x), model.encoder.forward_features(x))
        assert torch.equal(mae.load_encoder(out).eval().forward_features(x), model.encoder.forward_features(x))


def test_cli_with_decoder_and_without(tmp_path, capsys):
    model = mae.create_mae("mae_vit_micro_patch8")
    mae.weights.export.save_model(model, tmp_path / "mae.safetensors")
    source = str(tmp_path / "mae.safetensors")
    assert main(["export", "--checkpoint", source, "--output", str(tmp_path / "a.safetensors"), "--with_decoder"]) == 0
    _assert_same_mae(model.eval(), mae.load_pretrained(tmp_path / "a.safetensors").eval())
    assert (
        main(["export", "--checkpoint", str(tmp_path / "mae.safetensors"), "--output", str(tmp_path / "b.safetensors")])
        == 0
    )
    assert not (tmp_path / "b.decoder.safetensors").exists()
    with pytest.warns(UserWarning, match="freshly initialised"):
        mae.load_pretrained(tmp_path / "b.safetensors")
    # an encoder-only source has no trained decoder to write: a fresh one beside it would be read back as trained
    assert main(["export", "--checkpoint", str(tmp_path / "b.safetensors"), "--output", str(tmp_path / "c.safetensors"),
                 "--with_decoder"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no trained decoder to write beside the encoder; drop --with_decoder" in err[0]
    assert not (tmp_path / "c.safetensors").exists() and not (tmp_path / "c.decoder.safetensors").exists()


def _classifier_run(folder, classes=("cat", "dog", "eel")):
    spec = read_encoder("random:mae_vit_micro_patch8", seed=3)
    model, arch, args = build_classifier(spec, len(classes))
    torch.nn.init.normal_(model.head.weight, std=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"data": {"path": "imgs"}, "aug": {}}  # a fine-tuning run's
    save_classifier(model, folder / "classifier.safetensors", arch=arch, args=args, classes=list(classes),
                    mean=[0.4, 0.5, 0.6], std=[0.2, 0.3, 0.25], config=config)  # fmt: skip
    (folder / "metrics.jsonl").write_text(
        '{"step": 1, "epoch": 1, "loss": 1.0}\n{"step": 4, "epoch": 2, "eval": "val", "loss": 0.5, "top1": 87.5}\n'
    )
    return model.eval()


def test_a_classifier_hf_folder_loads_in_timm_with_label_names(tmp_path):
    import timm

    model = _classifier_run(tmp_path / "run")
    folder = export_classifier(tmp_path / "run", tmp_path / "hub", "hf-folder", license="mit")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_classes"] == 3 and cfg["label_names"] == ["cat", "dog", "eel"]
    assert cfg["pretrained_cfg"]["mean"] == [0.4, 0.5, 0.6] and cfg["model_args"]["in_chans"] == 3
    vit = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert vit.pretrained_cfg["label_names"] == ["cat", "dog", "eel"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vit(x), model(x))
    card = (folder / "README.md").read_text()
    assert "library_name: timm" in card and "license: mit" in card and "image-classification" in card
    assert "| fine-tune | 87.50 |" in card and "cat, dog, eel" in card
    assert mae.load_classifier(folder).classes == ["cat", "dog", "eel"]  # the folder predicts too


def test_the_encoder_card_describes_the_tokens_and_the_run(tmp_path):
    model = mae.create_mae("mae_vit_micro_patch8")
    card = (mae.export_encoder(model, tmp_path / "hub", "hf-folder", license="cc-by-4.0") / "README.md").read_text()
    prefix = model.adapter.num_prefix_tokens
    assert f"[N, {prefix} + L, 96]" in card and "license: cc-by-4.0" in card
    assert ("1 class token" if model.adapter.has_class_token else "no class token") in card
    assert "L = 4 x 4 = 16 patch tokens at 32x32" in card


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A stand-in Hub: records what huggingface_hub is asked to do, keeps the uploaded files, serves them to timm."""
    import huggingface_hub
    import timm.models._hub as timm_hub

    store, calls = tmp_path / "hub-store", []
    monkeypatch.setenv("HF_TOKEN", "hf_test")

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))

    def create_branch(self, repo_id, **kw):
        calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        calls.append(("upload_folder", repo_id, kw))
        shutil.copytree(folder_path, store / repo_id, dirs_exist_ok=True)
        return "https://huggingface.co/fake/commit"

    def download(repo_id, filename, revision=None, cache_dir=None, **kw):
        path = store / repo_id / filename
        if not path.is_file():
            raise huggingface_hub.errors.EntryNotFoundError(filename)
        return str(path)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(timm_hub, "hf_hub_download", download)
    return calls


def test_push_a_classifier_and_load_it_from_the_hub(tmp_path, hub, capsys):
    import timm

    model = _classifier_run(tmp_path / "run")
    argv = ["export", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "out"),
            "--push_to_hub", "me/tiny-cls", "--private", "--revision", "v1", "--license", "mit"]  # fmt: skip
    assert main(argv) == 0
    assert [c[0] for c in hub] == ["create_repo", "create_branch", "upload_folder"]
    assert hub[0][2]["private"] is True and hub[2][2]["revision"] == "v1"
    vit = timm.create_model("hf-hub:me/tiny-cls", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vit(x), model(x))


def test_push_an_encoder_and_load_it_from_the_hub(tmp_path, hub):
    import timm

    model = mae.create_mae("mae_vit_micro_patch8").eval()
    mae.export_encoder(model, tmp_path / "enc.safetensors")
    argv = ["export", "--checkpoint", str(tmp_path / "enc.safetensors"), "--output", str(tmp_path / "out"),
            "--push_to_hub", "me/tiny-enc"]  # fmt: skip
    assert main(argv) == 0 and hub[-1][0] == "upload_folder"
    local = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    pushed = timm.create_model("hf-hub:me/tiny-enc", pretrained=True).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = model.encoder.forward_features(x)
        assert torch.equal(pushed.forward_features(x), want) and torch.equal(local.forward_features(x), want)


def test_a_push_without_a_token_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login either
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    model = mae.create_mae("mae_vit_micro_patch8")
    mae.export_encoder(model, tmp_path / "enc.safetensors")
    argv = ["export", "--checkpoint", str(tmp_path / "enc.safetensors"), "--output", str(tmp_path / "out"),
            "--push_to_hub", "me/x"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no Hugging Face token" in err and "HF_TOKEN" in err
    assert not (tmp_path / "out").exists()  # nothing written before the token was found
