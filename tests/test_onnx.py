"""ONNX exports: encoders (pooled features, tokens) and classifiers (logits) run in onnxruntime as in torch, at any
batch size and channel count, with the input size and normalisation in the model's metadata."""

import json
import warnings

import numpy as np
import onnxruntime as ort  # the [onnx] extra, in dev: missing, the suite fails rather than skips
import pytest
import torch

import mae
from mae.cli import main
from mae.models.classifier import build_classifier
from mae.weights.classifier import save_classifier
from mae.weights.importers import read_encoder
from mae.weights.onnx import export_onnx, onnx_metadata
from mae.weights.record import read_spec


def _classifier(folder, spec, classes):
    """A classifier run's folder (classifier.safetensors) from an encoder spec, with a head that moves the logits."""
    model, arch, args = build_classifier(spec, len(classes))
    torch.nn.init.normal_(model.head.weight, std=0.1)
    save_classifier(model, folder / "classifier.safetensors", arch=arch, args=args, classes=classes,
                    mean=list(spec.mean), std=list(spec.std), record=spec.record)  # fmt: skip
    return model.eval()


def _run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in session.run(None, {"pixel_values": x.numpy()})]


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def vit_b(tmp_path_factory):
    """ViT-B/16 at 224 with random weights: its encoder and a 10-class classifier, each exported once."""
    folder = tmp_path_factory.mktemp("vit_b")
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_base_patch16").eval()
    encoder_onnx = export_onnx(model, folder / "encoder.onnx", verify=False)
    arch, args = model.adapter.timm_architecture()
    spec = mae.models.encoder.EncoderSpec(arch, args, model.encoder.state_dict(), (0.5, 0.4, 0.3), (0.2, 0.2, 0.3))
    classifier = _classifier(folder, spec, [f"c{i}" for i in range(10)])
    classifier_onnx = export_onnx(folder, folder / "classifier.onnx", verify=False)
    return model, encoder_onnx, classifier, classifier_onnx


@pytest.mark.slow  # ViT-B: ~1 min of exporting and running on 1 CPU thread
@pytest.mark.parametrize("batch", [1, 7])
def test_vit_b_encoder_and_classifier_match_torch(vit_b, batch):
    model, encoder_onnx, classifier, classifier_onnx = vit_b
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        tokens = model.encoder.forward_features(x)
        pooled = model.encoder.forward_head(tokens, pre_logits=True)
        logits = classifier(x)
    features, onnx_tokens = _run(encoder_onnx, x)
    assert features.shape == (batch, 768) and onnx_tokens.shape == (batch, 197, 768)
    _close(features, pooled)
    _close(onnx_tokens, tokens)
    (onnx_logits,) = _run(classifier_onnx, x)
    assert onnx_logits.shape == (batch, 10)
    _close(onnx_logits, logits)


@pytest.mark.slow
def test_metadata_records_input_size_normalisation_opset_and_classes(vit_b):
    _, encoder_onnx, _, classifier_onnx = vit_b
    meta = onnx_metadata(encoder_onnx)
    assert meta["mae_kind"] == "encoder" and json.loads(meta["input_size"]) == [3, 224, 224]
    assert json.loads(meta["outputs"]) == ["features", "tokens"] and meta["opset"] == "17"
    import onnx

    proto = onnx.load(str(encoder_onnx), load_external_data=False)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 17
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    meta = onnx_metadata(classifier_onnx)
    assert json.loads(meta["classes"]) == [f"c{i}" for i in range(10)]
    assert json.loads(meta["mean"]) == [0.5, 0.4, 0.3] and json.loads(meta["std"]) == [0.2, 0.2, 0.3]
    assert float(meta["crop_pct"]) == 0.875


def test_without_onnx_the_export_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(mae.ConfigError) as error:
        export_onnx(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "e.onnx")
    assert str(error.value) == "--format onnx needs the onnx package: pip install 'mae-toolkit[onnx]'"


def test_a_missing_source_is_one_line(tmp_path):
    with pytest.raises(mae.CheckpointError) as error:
        export_onnx(tmp_path / "none.safetensors", tmp_path / "none.onnx")
    assert str(error.value) == f"{tmp_path / 'none.safetensors'}: no such file or folder"


def test_an_encoder_only_file_exports_without_the_decoder_warning(tmp_path):
    """Given an input size, the export reads the file as a whole model, whose loader warns that the decoder is fresh;
    the export keeps no decoder, so it says nothing."""
    mae.export_encoder(mae.create_mae("mae_vit_micro_patch8", img_size=32), tmp_path / "enc.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_onnx(tmp_path / "enc.safetensors", tmp_path / "new" / "folders" / "enc.onnx", img_size=(32, 32))
    assert out.is_file()  # the folders made on the way
    assert [str(w.message) for w in caught if "encoder only" in str(w.message)] == []


def test_every_metadata_entry_of_an_encoder_and_a_classifier(tmp_path):
    """The metadata of small models, entry by entry (ViT-B's are checked by the slow test above)."""
    import onnx

    from mae.version import __version__

    model = mae.create_mae("mae_vit_micro_patch8", img_size=(16, 32)).eval()
    model.record_stats((0.5, 0.4, 0.3), (0.2, 0.2, 0.3))
    encoder_onnx = export_onnx(model, tmp_path / "encoder.onnx", opset=18)
    spec = mae.models.encoder.EncoderSpec(*model.adapter.timm_architecture(), model.encoder.state_dict(),
                                          (0.5, 0.4, 0.3), (0.2, 0.2, 0.3), record=model.spec)  # fmt: skip
    _classifier(tmp_path, spec, ["a", "b"])
    classifier_onnx = export_onnx(tmp_path, tmp_path / "classifier.onnx")
    common = {"input_name": "pixel_values", "mean": "[0.5, 0.4, 0.3]", "std": "[0.2, 0.2, 0.3]",
              "crop_pct": "0.875", "interpolation": "bicubic", "mae_version": __version__}  # fmt: skip
    meta = onnx_metadata(encoder_onnx)
    assert meta.pop("mae_spec") and meta == {
        **common, "mae_kind": "encoder", "outputs": '["features", "tokens"]', "input_size": "[3, 16, 32]", "opset": "18"
    }  # fmt: skip
    meta = onnx_metadata(classifier_onnx)
    assert meta.pop("mae_spec") and meta == {
        **common, "mae_kind": "classifier", "outputs": '["logits"]', "input_size": "[3, 16, 32]", "opset": "17",
        "classes": '["a", "b"]',
    }  # fmt: skip
    for path, opset, outputs in ((encoder_onnx, 18, ["features", "tokens"]), (classifier_onnx, 17, ["logits"])):
        proto = onnx.load(str(path), load_external_data=False)
        assert {o.domain: o.version for o in proto.opset_import}[""] == opset
        assert [i.name for i in proto.graph.input] == ["pixel_values"] and [
            o.name for o in proto.graph.output
        ] == outputs
        assert all(
            v.type.tensor_type.shape.dim[0].dim_param == "batch" for v in [*proto.graph.input, *proto.graph.output]
        )
        architecture = "" if path == encoder_onnx else "vit_tiny_patch16_224 "  # timm's name; an encoder's cfg has none
        assert proto.doc_string == f"{architecture}exported by mae {__version__}"


@pytest.mark.parametrize("in_chans", [1, 13])
def test_any_channel_count_encoder_and_classifier(tmp_path, in_chans):
    model = mae.create_mae("mae_vit_micro_patch8", in_chans=in_chans).eval()
    with pytest.raises(mae.CheckpointError, match=f"normalisation for its {in_chans} channels was never recorded"):
        mae.export_encoder(model, tmp_path / "enc.safetensors")  # no default statistics beside 3 channels
    model.record_stats((0.5,) * in_chans, tuple(0.1 + i / 100 for i in range(in_chans)))
    mae.export_encoder(model, tmp_path / "enc.safetensors")
    encoder_onnx = export_onnx(tmp_path / "enc.safetensors", tmp_path / "enc.onnx")  # verified as it is written
    spec = read_encoder(str(tmp_path / "enc.safetensors"))
    classifier = _classifier(tmp_path, spec, ["a", "b", "c"])
    classifier_onnx = export_onnx(tmp_path / "classifier.safetensors", tmp_path / "cls.onnx")
    assert json.loads(onnx_metadata(encoder_onnx)["input_size"]) == [in_chans, 32, 32]
    assert len(json.loads(onnx_metadata(encoder_onnx)["mean"])) == in_chans
    assert read_spec(encoder_onnx) == model.spec == read_spec(tmp_path / "enc.safetensors")
    classifier_record = read_spec(classifier_onnx)
    assert classifier_record.std == model.spec.std and classifier_record.embed_dim == model.spec.embed_dim
    for batch in (1, 7):
        x = torch.randn(batch, in_chans, 32, 32)
        with torch.no_grad():
            _close(_run(encoder_onnx, x)[1], model.encoder.forward_features(x))
            _close(_run(classifier_onnx, x)[0], classifier(x))


def test_cli_onnx_of_a_classifier_folder(tmp_path, capsys):
    spec = read_encoder("random:mae_vit_micro_patch8", seed=2)
    classifier = _classifier(tmp_path, spec, ["x", "y"])
    assert (
        main(["export", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "c.onnx"), "--format", "onnx"]) == 0
    )
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        _close(_run(tmp_path / "c.onnx", x)[0], classifier(x))


def test_unknown_input_size_is_one_line_and_img_size_fixes_it(tmp_path, capsys):
    """A timm-key encoder state dict with a 2 x 4 patch grid and no metadata: nothing tells H and W."""
    model = mae.create_mae("mae_vit_micro_patch8", img_size=(16, 32))
    torch.save(model.encoder.state_dict(), tmp_path / "enc.pth")
    argv = [
        "export",
        "--checkpoint",
        str(tmp_path / "enc.pth"),
        "--output",
        str(tmp_path / "e.onnx"),
        "--format",
        "onnx",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "input size is unknown" in err and "--img_size" in err
    with pytest.raises(mae.CheckpointError) as error:
        export_onnx(tmp_path / "enc.pth", tmp_path / "e.onnx")
    assert str(error.value).startswith(f"{tmp_path / 'enc.pth'}: its input size is unknown (")
    assert str(error.value).endswith("); give it with --img_size H W")
    assert main([*argv, "--img_size", "[16, 32]"]) == 0
    x = torch.randn(2, 3, 16, 32)
    with torch.no_grad():
        _close(_run(tmp_path / "e.onnx", x)[1], model.encoder.forward_features(x))
    assert np.isfinite(_run(tmp_path / "e.onnx", x)[0].numpy()).all()


def test_the_exports_own_check_refuses_a_wrong_graph_and_checks_nothing_without_onnxruntime(tmp_path, monkeypatch):
    """`export_onnx(verify=True)` compares onnxruntime with torch: a graph of other weights is refused with one line;
    without onnxruntime `check_onnx` checks nothing and says so by returning 0.0."""
    import sys

    from mae.errors import CheckpointError
    from mae.weights import onnx as onnx_export

    torch.manual_seed(0)
    right, wrong = (mae.create_mae("mae_vit_micro_patch8", img_size=32).eval() for _ in range(2))
    good = export_onnx(right, tmp_path / "good.onnx")  # verify=True: the graph of these weights passes
    net = onnx_export._Outputs(onnx_export.open_deployable(right, None).model, False).eval()
    assert 0.0 < onnx_export.check_onnx(good, net) <= onnx_export.TOLERANCE * 10
    real = torch.onnx.export
    other = onnx_export._Outputs(onnx_export.open_deployable(wrong, None).model, False).eval()
    monkeypatch.setattr(torch.onnx, "export", lambda _net, *a, **k: real(other, *a, **k))  # writes the wrong graph
    with pytest.raises(CheckpointError, match=r"bad\.onnx: onnxruntime's outputs differ from torch's by up to .* at "
                       r"batch 1; the export is wrong$"):  # fmt: skip
        export_onnx(right, tmp_path / "bad.onnx")
    for offset, refused in ((1e-2, True), (1.5e-4, True), (8e-5, False)):  # the tolerance: 1e-4 x (1 + |output|)
        nudged = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
        nudged.load_state_dict(right.state_dict())
        with torch.no_grad():
            nudged.encoder.norm.bias += offset  # every output moves by `offset`; many are below 0.5 in size
        close = onnx_export._Outputs(onnx_export.open_deployable(nudged, None).model, False).eval()
        monkeypatch.setattr(torch.onnx, "export", lambda _net, *a, c=close, **k: real(c, *a, **k))
        if refused:
            with pytest.raises(CheckpointError, match="the export is wrong$"):
                export_onnx(right, tmp_path / "close.onnx")
        else:
            export_onnx(right, tmp_path / "close.onnx")  # within atol = rtol = 1e-4 of torch's
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails as where it is not installed
    assert onnx_export.check_onnx(tmp_path / "bad.onnx", net) == 0.0
