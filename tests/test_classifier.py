"""Classifiers out and back: `build_classifier` from an `EncoderSpec`, `save_classifier`, `load_classifier`."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import mae
from mae.errors import CheckpointError
from mae.models.classifier import build_classifier
from mae.models.encoder import EncoderSpec
from mae.weights.classifier import save_classifier
from mae.weights.importers import read_encoder


def _save(spec: EncoderSpec, folder, classes):
    model, arch, args = build_classifier(spec, len(classes))
    torch.nn.init.normal_(model.head.bias)  # a head that changes the logits
    save_classifier(model, folder / "classifier.safetensors", arch=arch, args=args, classes=classes,
                    mean=list(spec.mean), std=list(spec.std))  # fmt: skip
    (folder / "classes.json").write_text(json.dumps(classes))
    return model.eval()


def test_a_saved_classifier_loads_with_its_transform_and_classes(tmp_path):
    spec = read_encoder("random:mae_vit_micro_patch8", seed=1)
    model = _save(spec, tmp_path, ["cat", "dog", "eel"])
    loaded = mae.load_classifier(tmp_path)
    assert loaded.classes == ["cat", "dog", "eel"] and not loaded.model.training
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
    x = loaded.transform(image)
    assert x.shape == (3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x[None]), model(x[None]))
    assert mae.load_classifier(tmp_path / "classifier.safetensors").classes == loaded.classes


def test_a_one_channel_classifier_transforms_float_tensors(tmp_path):
    enc = mae.create_mae("mae_vit_micro_patch8", in_chans=1)
    arch, args = enc.adapter.timm_architecture()
    spec = EncoderSpec(arch, args, enc.encoder.state_dict(), (0.5,), (0.25,))
    assert spec.in_chans == 1 and spec.img_size == (32, 32) and spec.has_class_token
    model = _save(spec, tmp_path, ["a", "b"])
    loaded = mae.load_classifier(tmp_path)
    x = loaded.transform(torch.rand(1, 40, 40))
    assert x.shape == (1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x[None]), model(x[None]))


def test_an_encoder_export_is_not_a_classifier(tmp_path):
    path = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "encoder.safetensors")
    with pytest.raises(CheckpointError, match="an encoder export has no classifier head; fine-tune or probe it"):
        mae.load_classifier(path)
    with pytest.raises(CheckpointError, match="an encoder export has no classifier head"):
        mae.load_classifier(tmp_path)  # a pretraining folder


def test_random_encoders_follow_the_seed_and_leave_the_global_stream():
    state = torch.random.get_rng_state()
    a, b = read_encoder("random:mae_vit_micro_patch8", seed=3), read_encoder("random:mae_vit_micro_patch8", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    c = read_encoder("random:mae_vit_micro_patch8", seed=4)
    assert not torch.equal(a.state["blocks.0.attn.qkv.weight"], c.state["blocks.0.attn.qkv.weight"])
