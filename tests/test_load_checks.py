"""load_pretrained's checks and what it reads beside a file: the options the weights fix, a file that does not fit,
position tables rebuilt, the decoder sibling of an encoder export (recorded, older, foreign), older runs' config.yaml,
and the warnings' wording and line. Each error is one whole line."""

import json
import re
import warnings

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import mae
from mae.weights.export import save_model
from mae.weights.files import read_metadata
from mae.weights.importers import CheckpointError, load_noting_decoder


@pytest.fixture
def full(tmp_path):
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32, decoder_depth=1)
    return model, save_model(model, tmp_path / "full.safetensors")


def error_of(path, **overrides):
    with pytest.raises(CheckpointError) as error:
        mae.load_pretrained(path, **overrides)
    return str(error.value)


def test_the_options_the_weights_fix_must_agree(full):
    model, path = full
    for name, asked, stored in (("patch_size", 16, 8), ("embed_dim", 64, 96), ("depth", 2, 3)):
        assert error_of(path, **{name: asked}) == (
            f"{path}: its weights have {name} {stored}, not the {asked} asked for; drop that option or set it to "
            f"{stored}"
        )
    same = mae.load_pretrained(path, patch_size=8, embed_dim=96, depth=3, img_size=48, norm_pix_loss=None)
    assert same.img_size == (48, 48) and same.norm_pix_loss == model.norm_pix_loss  # None: the record's value
    fresh = mae.create_mae("mae_vit_micro_patch8", img_size=48, decoder_depth=1)
    assert torch.equal(same.encoder.pos_embed, fresh.encoder.pos_embed)  # the fixed tables rebuilt for 6 x 6
    assert torch.equal(same.decoder.pos_embed, fresh.decoder.pos_embed)
    assert torch.equal(same.encoder.blocks[2].mlp.fc1.weight, model.encoder.blocks[2].mlp.fc1.weight)


def test_a_model_the_options_cannot_build_is_one_line(full):
    _, path = full
    for bad in ({"img_size": 30}, {"num_heads": 5}):  # not a multiple of the patch; 96 wide in 5 heads (timm asserts)
        message = error_of(path, **bad)
        assert message.startswith(f"{path}: cannot build the model it describes (") and "\n" not in message


def test_weights_that_do_not_fit_are_one_line(full, tmp_path):
    model, path = full
    state, meta = load_file(path), read_metadata(path)
    state["decoder.pred.bias"] = torch.zeros(5)
    save_file(state, tmp_path / "one_off.safetensors", metadata=meta)
    message = error_of(tmp_path / "one_off.safetensors")
    assert message == (
        f"{tmp_path / 'one_off.safetensors'}: the weights do not fit the model the options describe (size mismatch "
        "for decoder.pred.bias: copying a param with shape torch.Size([5]) from checkpoint, the shape in current model "
        "is torch.Size([192]).)"
    )
    order = list(model.state_dict())
    gone = [k for k in order if k.startswith("encoder.blocks.1.")][:4]
    state = {k: v for k, v in load_file(path).items() if k not in gone}
    state.update({f"encoder.extra{i}": torch.zeros(1) for i in range(4)})
    save_file(state, tmp_path / "odd.safetensors", metadata=meta)
    assert error_of(tmp_path / "odd.safetensors") == (
        f"{tmp_path / 'odd.safetensors'}: does not fit the architecture inferred from it (mae); missing {gone[:3]}, "
        f"unexpected {['encoder.extra0', 'encoder.extra1', 'encoder.extra2']}"
    )
    no_decoder_key = {k: v for k, v in load_file(path).items() if k != "decoder.pred.bias"}
    save_file(no_decoder_key, tmp_path / "short.safetensors", metadata=meta)
    assert error_of(tmp_path / "short.safetensors") == (
        f"{tmp_path / 'short.safetensors'}: does not fit the architecture inferred from it (mae); missing "
        "['decoder.pred.bias'], unexpected []"
    )


def test_an_encoder_only_file_warns_at_the_callers_line_and_load_noting_decoder_answers_it(tmp_path, full):
    model, _ = full
    path = mae.export_encoder(model, tmp_path / "enc.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mae.load_pretrained(path)
    assert [(str(w.message), w.filename) for w in caught] == [
        (f"{path} holds an encoder only (timm/official encoder); the decoder is freshly initialised", __file__)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, has_decoder = load_noting_decoder(path, in_chans=1)
    assert not has_decoder and loaded.in_chans == 1
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "3-channel weights adapted to 1 channels (patch embedding as timm's adapt_input_conv; the decoder's pixel head "
        "starts fresh)"
    ]  # the other warnings pass on; the encoder-only one is the flag
    assert load_noting_decoder(full[1])[1] is True


def test_the_decoder_beside_an_export_its_record_or_an_older_one(tmp_path, full):
    """An encoder export's sibling decoder file is read (its record, or an older `mae_model_args`), with the encoder
    file's statistics; a sibling without either is refused in one line; a file that holds a decoder itself, or is no
    safetensors, never reads a sibling."""
    model, path = full
    enc = mae.export_encoder(model, tmp_path / "e.safetensors")
    decoder = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("decoder.")}
    spec = json.loads(read_metadata(path)["mae_spec"])
    save_file(
        decoder,
        tmp_path / "e.decoder.safetensors",
        metadata={"mae_spec": json.dumps({**spec, "mean": [0.1] * 3, "std": [0.9] * 3})},
    )
    meta = read_metadata(enc)
    save_file(
        load_file(enc), enc, metadata={**meta, "mae_spec": json.dumps({**spec, "mean": [0.2] * 3, "std": [0.7] * 3})}
    )
    loaded = mae.load_pretrained(enc)
    assert loaded.spec.mean == (0.2,) * 3 and loaded.spec.std == (0.7,) * 3  # the encoder file's statistics
    assert torch.equal(loaded.decoder.pred.weight, model.decoder.pred.weight)
    args = {"decoder_embed_dim": 64, "decoder_depth": 1, "decoder_num_heads": 2}
    save_file(decoder, tmp_path / "e.decoder.safetensors", metadata={"mae_model_args": json.dumps(args)})
    assert torch.equal(mae.load_pretrained(enc).decoder.pred.weight, model.decoder.pred.weight)
    save_file(decoder, tmp_path / "e.decoder.safetensors", metadata={"format": "pt"})
    assert error_of(enc) == (
        f"{tmp_path / 'e.decoder.safetensors'}: not a decoder export of this toolkit (no model record in its metadata)"
    )
    torch.manual_seed(1)
    other = mae.create_mae("mae_vit_micro_patch8", img_size=32, decoder_depth=1)
    save_model(other, tmp_path / "full.decoder.safetensors")  # beside a file with a decoder of its own: ignored
    assert torch.equal(mae.load_pretrained(path).decoder.pred.weight, model.decoder.pred.weight)


def test_an_older_runs_checkpoint_is_read_by_its_config(tmp_path, full):
    model, _ = full
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt / "model.safetensors")
    config = {"model": {"name": "mae_vit_micro_patch8", "img_size": 32, "mask_ratio": 0.75, "norm_pix_loss": True,
                        "decoder_num_heads": 4},
              "data": {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.5, 0.5]}}  # fmt: skip
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    loaded = mae.load_pretrained(tmp_path / "run")
    assert loaded.spec.mean == (0.2, 0.3, 0.4) and loaded.decoder.blocks[0].attn.num_heads == 4
    assert torch.equal(loaded.encoder.blocks[0].attn.qkv.weight, model.encoder.blocks[0].attn.qkv.weight)


def test_a_state_dict_wrapped_twice_is_refused(tmp_path, full):
    torch.save({"model": {"state_dict": load_file(full[1])}}, tmp_path / "twice.pth")
    assert error_of(tmp_path / "twice.pth") == (
        f"{tmp_path / 'twice.pth'}: expected a state dict of tensors (or {{'model': state_dict}})"
    )


def test_a_classifier_with_both_norms_keeps_its_final_norm_and_says_what_does_not_fit(tmp_path):
    from tests.test_importers import DHEADS, HEADS, official_state

    state = official_state(decoder=False)
    state.update({"head.weight": torch.randn(10, 64), "head.bias": torch.randn(10), "fc_norm.weight": torch.ones(64),
                  "fc_norm.bias": torch.zeros(64)})  # fmt: skip
    save_file(state, tmp_path / "both.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message = error_of(tmp_path / "both.safetensors", num_heads=HEADS, decoder_num_heads=DHEADS)
    fits = r": does not fit the architecture inferred from it \(timm/official encoder\); missing \[\], unexpected "
    assert re.fullmatch(
        r".*" + fits + r"\['encoder\.fc_norm\.(weight|bias)', 'encoder\.fc_norm\.(weight|bias)'\]", message
    )


def test_rgb_weights_for_one_channel_adapt_the_patch_embedding_and_leave_the_pixel_head_fresh(full):
    from timm.models import adapt_input_conv

    model, path = full
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gray = mae.load_pretrained(path, in_chans=1)
    assert [(str(w.message), w.filename) for w in caught] == [
        (f"{path}: 3-channel weights adapted to 1 channels (patch embedding as timm's adapt_input_conv; the decoder's "
         "pixel head starts fresh)", __file__)
    ]  # fmt: skip
    proj = model.encoder.patch_embed.proj.weight
    assert torch.equal(gray.encoder.patch_embed.proj.weight, adapt_input_conv(1, proj.detach(), base_chans=3))
    assert gray.decoder.pred.weight.shape[0] == 8 * 8 and torch.equal(
        gray.decoder.embed.weight, model.decoder.embed.weight
    )


def test_read_encoder_finds_the_encoder_of_each_kind_of_path(tmp_path, full):
    from mae.weights.importers import read_encoder

    model, path = full
    want = model.encoder.state_dict()
    run = tmp_path / "run"
    run.mkdir()
    mae.export_encoder(model, run / "encoder.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    mae.export_encoder(model, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    for where in (run, hf, run / "encoder.safetensors", path):
        spec = read_encoder(str(where))
        assert spec.arch == "vit_tiny_patch16_224" and spec.args["embed_dim"] == 96 and spec.args["patch_size"] == 8
        assert all(torch.equal(spec.state[k], v) for k, v in want.items()) and spec.record == model.spec, where
    bare = read_encoder("random:mae_vit_micro_patch8")
    assert all(
        torch.equal(v, read_encoder("random:mae_vit_micro_patch8", seed=0).state[k]) for k, v in bare.state.items()
    )
    other = read_encoder("random:mae_vit_micro_patch8", seed=1)
    assert not torch.equal(bare.state["blocks.0.attn.qkv.weight"], other.state["blocks.0.attn.qkv.weight"])
    assert read_encoder("random:mae_vit_micro_patch8", img_size=48).record.img_size == (48, 48)


def test_read_encoder_of_older_exports_and_foreign_files(tmp_path):
    """An export from before the model record (timm's architecture and args in its metadata) is read as it is, its
    record made from them (statistics from its hints, a classifier's num_classes dropped); a foreign timm state dict
    is read through load_pretrained without the encoder-only warning; statistics come from the record."""
    import timm

    from mae.weights.importers import read_encoder

    vit = timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, depth=1)
    args = {"img_size": 32, "patch_size": 8, "embed_dim": 192, "depth": 1, "num_heads": 3, "num_classes": 10}
    meta = {"architecture": "vit_tiny_patch16_224", "model_args": json.dumps(args), "mean": "[0.1, 0.2, 0.3]",
            "std": "[0.4, 0.5, 0.6]"}  # fmt: skip
    save_file(vit.state_dict(), tmp_path / "old.safetensors", metadata=meta)
    spec = read_encoder(str(tmp_path / "old.safetensors"))
    assert spec.arch == "vit_tiny_patch16_224" and "num_classes" not in spec.args and spec.args["depth"] == 1
    assert spec.record.mean == (0.1, 0.2, 0.3) and (spec.mean, spec.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    torch.save(vit.state_dict(), tmp_path / "foreign.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        foreign = read_encoder(str(tmp_path / "foreign.pth"))
    assert torch.equal(foreign.state["blocks.0.attn.qkv.weight"], vit.state_dict()["blocks.0.attn.qkv.weight"])
    assert foreign.record.num_heads == 3 and (foreign.mean, foreign.std) == foreign.record.input_stats()


def test_an_export_with_timms_args_is_read_as_it_is_even_where_no_mae_describes_it(tmp_path):
    """timm's architecture and args in the metadata (an encoder export's) are taken as they are, here a ViT without
    qkv biases, which no MaskedAutoencoder builds; under a run folder, an hf folder or as the file itself."""
    import timm

    from mae.weights.importers import read_encoder

    args = {"img_size": 32, "patch_size": 8, "embed_dim": 192, "depth": 1, "num_heads": 3, "qkv_bias": False}
    vit = timm.create_model("vit_tiny_patch16_224", num_classes=0, **args)
    meta = {"architecture": "vit_tiny_patch16_224", "model_args": json.dumps(args)}
    for folder, name in (("run", "encoder.safetensors"), ("hf", "model.safetensors"), ("file", "vit.safetensors")):
        (tmp_path / folder).mkdir()
        save_file(vit.state_dict(), tmp_path / folder / name, metadata=meta)
        if folder == "hf":
            (tmp_path / folder / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
        where = tmp_path / folder / name if folder == "file" else tmp_path / folder
        spec = read_encoder(str(where))
        assert spec.args["qkv_bias"] is False and "blocks.0.attn.qkv.bias" not in spec.state, folder
        assert spec.state.keys() == vit.state_dict().keys()


def test_an_export_with_only_part_of_timms_metadata_is_read_through_its_record(tmp_path, full):
    from mae.weights.importers import read_encoder

    model, _ = full
    path = mae.export_encoder(model, tmp_path / "e.safetensors")
    meta = read_metadata(path)
    for drop in ("model_args", "architecture"):
        save_file(
            load_file(path), tmp_path / f"no_{drop}.safetensors", metadata={k: v for k, v in meta.items() if k != drop}
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            spec = read_encoder(str(tmp_path / f"no_{drop}.safetensors"))
        assert spec.record == model.spec and torch.equal(spec.state["pos_embed"], model.encoder.pos_embed), drop
