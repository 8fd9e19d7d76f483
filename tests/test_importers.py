"""load_pretrained against the formulations it imports: the official code's and transformers'."""

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency (the parity reference): missing, the suite fails rather than skips
from safetensors.torch import save_file

import mae
from mae.weights.importers import CheckpointError

D, DEPTH, HEADS, DD, DDEPTH, DHEADS, P, IMG = 64, 2, 4, 32, 2, 2, 8, 32
L = (IMG // P) ** 2


def official_state(decoder=True, seed=0):
    """Random tensors in the official models_mae.py key layout and shapes (no code of ours)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"cls_token": (1, 1, D), "pos_embed": (1, L + 1, D), "patch_embed.proj.weight": (D, 3, P, P),
              "patch_embed.proj.bias": (D,), "norm.weight": (D,), "norm.bias": (D,)}  # fmt: skip

    def block(prefix, d):
        names = {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
                 "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,),
                 "mlp.fc1.weight": (4 * d, d), "mlp.fc1.bias": (4 * d,), "mlp.fc2.weight": (d, 4 * d),
                 "mlp.fc2.bias": (d,)}  # fmt: skip
        return {prefix + k: v for k, v in names.items()}

    for i in range(DEPTH):
        shapes.update(block(f"blocks.{i}.", D))
    if decoder:
        shapes.update({"mask_token": (1, 1, DD), "decoder_embed.weight": (DD, D), "decoder_embed.bias": (DD,),
                       "decoder_pos_embed": (1, L + 1, DD), "decoder_norm.weight": (DD,), "decoder_norm.bias": (DD,),
                       "decoder_pred.weight": (P * P * 3, DD), "decoder_pred.bias": (P * P * 3,)})  # fmt: skip
        for i in range(DDEPTH):
            shapes.update(block(f"decoder_blocks.{i}.", DD))
    return {k: torch.randn(s, generator=g) * (0.2 if "norm" not in k else 1.0) for k, s in shapes.items()}


def official_forward(sd, imgs, noise, mask_ratio=0.75, norm_pix_loss=True):
    """The official forward (models_mae.py), written out over the raw state dict."""

    def block(x, pre, heads):
        h = F.layer_norm(x, x.shape[-1:], sd[pre + "norm1.weight"], sd[pre + "norm1.bias"], eps=1e-6)
        b, n, c = h.shape
        qkv = F.linear(h, sd[pre + "attn.qkv.weight"], sd[pre + "attn.qkv.bias"])
        q, k, v = qkv.reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (c // heads) ** -0.5).softmax(dim=-1)
        x = x + F.linear((attn @ v).transpose(1, 2).reshape(b, n, c), sd[pre + "attn.proj.weight"],
                         sd[pre + "attn.proj.bias"])  # fmt: skip
        h = F.layer_norm(x, x.shape[-1:], sd[pre + "norm2.weight"], sd[pre + "norm2.bias"], eps=1e-6)
        h = F.linear(F.gelu(F.linear(h, sd[pre + "mlp.fc1.weight"], sd[pre + "mlp.fc1.bias"])),
                     sd[pre + "mlp.fc2.weight"], sd[pre + "mlp.fc2.bias"])  # fmt: skip
        return x + h

    x = F.conv2d(imgs, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=P).flatten(2).transpose(1, 2)
    x = x + sd["pos_embed"][:, 1:, :]
    n, length, d = x.shape
    len_keep = int(length * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    x = torch.gather(x, 1, ids_shuffle[:, :len_keep].unsqueeze(-1).repeat(1, 1, d))
    mask = torch.ones([n, length])
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, 1, ids_restore)
    x = torch.cat([(sd["cls_token"] + sd["pos_embed"][:, :1, :]).expand(n, -1, -1), x], dim=1)
    for i in range(DEPTH):
        x = block(x, f"blocks.{i}.", HEADS)
    x = F.layer_norm(x, x.shape[-1:], sd["norm.weight"], sd["norm.bias"], eps=1e-6)
    x = F.linear(x, sd["decoder_embed.weight"], sd["decoder_embed.bias"])
    mask_tokens = sd["mask_token"].repeat(n, length + 1 - x.shape[1], 1)
    x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
    x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
    x = torch.cat([x[:, :1, :], x_], dim=1) + sd["decoder_pos_embed"]
    for i in range(DDEPTH):
        x = block(x, f"decoder_blocks.{i}.", DHEADS)
    x = F.layer_norm(x, x.shape[-1:], sd["decoder_norm.weight"], sd["decoder_norm.bias"], eps=1e-6)
    pred = F.linear(x, sd["decoder_pred.weight"], sd["decoder_pred.bias"])[:, 1:, :]
    h = w = imgs.shape[2] // P
    target = torch.einsum("nchpwq->nhwpqc", imgs.reshape(n, 3, h, P, w, P)).reshape(n, h * w, P * P * 3)
    if norm_pix_loss:
        target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(dim=-1)
    return (loss * mask).sum() / mask.sum(), pred, mask


def test_official_checkpoint_matches_the_official_formulation(tmp_path):
    sd = official_state()
    torch.save({"model": sd}, tmp_path / "checkpoint-799.pth")
    model = mae.load_pretrained(tmp_path / "checkpoint-799.pth", num_heads=HEADS, decoder_num_heads=DHEADS).eval()
    imgs, noise = torch.randn(3, 3, IMG, IMG), torch.rand(3, L)
    ref_loss, ref_pred, ref_mask = official_forward(sd, imgs, noise)
    with torch.no_grad():
        out = model(imgs, noise=noise)
    assert torch.equal(out.mask, ref_mask)
    torch.testing.assert_close(out.pred, ref_pred, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_official_encoder_only_gets_a_fresh_decoder(tmp_path):
    sd = official_state(decoder=False)
    torch.save({"model": sd}, tmp_path / "mae_pretrain_vit.pth")
    with pytest.warns(UserWarning, match="encoder only"):
        model = mae.load_pretrained(tmp_path / "mae_pretrain_vit.pth", num_heads=HEADS)
    assert torch.equal(model.encoder.blocks[1].attn.qkv.weight, sd["blocks.1.attn.qkv.weight"])
    assert model.decoder.embed.out_features == 512 and len(model.decoder.blocks) == 8  # the paper's decoder


def test_timm_mae_encoder_state_dict(tmp_path):
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=0)
    save_file(vit.state_dict(), tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="encoder only"):
        model = mae.load_pretrained(tmp_path / "model.safetensors")
    assert model.encoder.embed_dim == 192 and model.encoder.blocks[0].attn.num_heads == 3
    assert torch.equal(model.encoder.blocks[0].mlp.fc1.weight, vit.blocks[0].mlp.fc1.weight)


@pytest.mark.parametrize("as_file", [False, True])
def test_transformers_vitmae_matches_transformers(tmp_path, as_file):
    cfg = transformers.ViTMAEConfig(
        image_size=IMG, patch_size=P, hidden_size=D, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
        intermediate_size=4 * D, decoder_hidden_size=DD, decoder_num_hidden_layers=DDEPTH,
        decoder_num_attention_heads=DHEADS, decoder_intermediate_size=4 * DD, layer_norm_eps=1e-6, norm_pix_loss=True,
    )  # fmt: skip
    hf = transformers.ViTMAEForPreTraining(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "pos_embed" not in name and "position_embeddings" not in name:
                p.normal_(0, 0.1)
        hf.vit.embeddings.patch_embeddings.projection._is_hf_initialized = False
        hf.vit.embeddings.initialize_weights()  # the real sine-cosine tables
        hf.decoder.initialize_weights(L)
    hf.save_pretrained(tmp_path / "hf")
    src = tmp_path / "hf" / "model.safetensors" if as_file else tmp_path / "hf"
    model = mae.load_pretrained(src).eval()
    imgs, noise = torch.randn(2, 3, IMG, IMG), torch.rand(2, L)
    with torch.no_grad():
        a, b = model(imgs, noise=noise), hf(pixel_values=imgs, noise=noise)
    torch.testing.assert_close(a.pred, b.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(
        model.encoder.pos_embed, mae.create_mae("mae_vit_micro_patch8", embed_dim=D, num_heads=HEADS).encoder.pos_embed
    )


def test_convert_round_trip(tmp_path):
    from mae.cli import main

    sd = official_state()
    torch.save({"model": sd}, tmp_path / "o.pth")
    assert main(["convert", str(tmp_path / "o.pth"), "--output", str(tmp_path / "m.safetensors"),
                 "--num_heads", str(HEADS), "--decoder_num_heads", str(DHEADS)]) == 0  # fmt: skip
    a = mae.load_pretrained(tmp_path / "m.safetensors")
    b = mae.load_pretrained(tmp_path / "o.pth", num_heads=HEADS, decoder_num_heads=DHEADS)
    assert a.encoder.blocks[0].attn.num_heads == HEADS and a.decoder.blocks[0].attn.num_heads == DHEADS
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


class NotAStateDict:
    pass


def test_bad_files_are_one_line_errors(tmp_path):
    text = tmp_path / "notes.pth"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match="notes.pth: not a readable PyTorch checkpoint"):
        mae.load_pretrained(text)
    torch.save({"model": official_state()}, tmp_path / "full.pth")
    data = (tmp_path / "full.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.pth: not a readable PyTorch checkpoint"):
        mae.load_pretrained(tmp_path / "cut.pth")
    torch.save({"model": NotAStateDict()}, tmp_path / "code.pth")
    with pytest.raises(CheckpointError, match="code.pth: refusing to load: it needs pickled code"):
        mae.load_pretrained(tmp_path / "code.pth")
    import torchvision

    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(CheckpointError, match="resnet.pth: not a ViT MAE checkpoint"):
        mae.load_pretrained(tmp_path / "resnet.pth")
    save_file({"x": torch.zeros(3)}, tmp_path / "x.safetensors")
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:20])
    with pytest.raises(CheckpointError, match="bad.safetensors: not a readable safetensors file"):
        mae.load_pretrained(tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="cannot tell the head count"):
        mae.load_pretrained(tmp_path / "full.pth")  # 64 wide: no standard head count
    for err in (CheckpointError,):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(err, match="no such file"):
                mae.load_pretrained(tmp_path / "missing.pth")


class _Code:
    """An object whose unpickling would run code of this module: refused by a weights-only load."""


def test_a_checkpoint_read_says_what_is_wrong_with_the_file_in_one_line(tmp_path, monkeypatch):
    import pickle

    from mae.weights.importers import read_tensors

    path = tmp_path / "code.pth"
    torch.save({"model": _Code()}, path)
    try:
        torch.load(str(path), weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0]
    with pytest.raises(CheckpointError) as error:
        read_tensors(path)
    assert str(error.value) == (
        f"{path}: refusing to load: it needs pickled code to run ({reason}); re-save its state dict or convert it to "
        "safetensors"
    )

    def unpickle_error(*args, **kwargs):
        raise pickle.UnpicklingError()

    monkeypatch.setattr(torch, "load", unpickle_error)
    with pytest.raises(CheckpointError, match=r"needs pickled code to run \(unsupported pickle\); re-save"):
        read_tensors(path)
    monkeypatch.undo()
    (tmp_path / "cut.pth").write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError) as error:
        read_tensors(tmp_path / "cut.pth")
    assert str(error.value).startswith(f"{tmp_path / 'cut.pth'}: not a readable PyTorch checkpoint, truncated or "
                                       "corrupt? (") and str(error.value).endswith(")")  # fmt: skip


@pytest.mark.parametrize("key", ["model", "state_dict", "module", None])
def test_a_state_dict_is_read_bare_or_under_its_usual_keys(tmp_path, key):
    from mae.weights.importers import read_tensors

    state = {"w": torch.arange(3.0)}
    torch.save(state if key is None else {key: state, "epoch": 3}, tmp_path / "c.pth")
    tensors, meta = read_tensors(tmp_path / "c.pth")
    assert tensors.keys() == {"w"} and torch.equal(tensors["w"], state["w"]) and meta == {}


def test_each_layout_is_named_and_a_stray_patch_embedding_is_no_vit(tmp_path):
    from mae.weights.importers import to_mae_keys

    official = official_state(decoder=True)
    encoder_only = official_state(decoder=False)
    ours = mae.create_mae("mae_vit_micro_patch8").state_dict()
    hf = mae.weights.importers.mae_to_hf_vitmae(ours)
    names = [to_mae_keys(s, tmp_path)[1] for s in (official, encoder_only, ours, hf)]
    assert names == ["official", "timm/official encoder", "mae", "transformers"]
    stray = {k: official["patch_embed.proj.weight"] for k in ("patch_embed.proj.weight", "a", "b", "c")}
    with pytest.raises(CheckpointError) as error:
        to_mae_keys(stray, tmp_path)
    assert str(error.value) == (
        f"{tmp_path}: not a ViT MAE checkpoint: no encoder weights in it (found keys like ['a', 'b', 'c']; expected "
        "timm ViT keys such as blocks.0.attn.qkv.weight, transformers' vit.embeddings.*, or this project's encoder.*)"
    )


@pytest.mark.parametrize("content", [{"w": 3}, [torch.zeros(1)]])
def test_a_file_of_other_things_than_tensors_is_one_line(tmp_path, content):
    from mae.weights.importers import read_tensors

    torch.save(content, tmp_path / "c.pth")
    with pytest.raises(CheckpointError) as error:
        read_tensors(tmp_path / "c.pth")
    assert str(error.value) == f"{tmp_path / 'c.pth'}: expected a state dict of tensors (or {{'model': state_dict}})"


def classifier_state(fc_norm):
    """A timm classifier in the official layout: the encoder, a head, and (global-pool ViTs) fc_norm in place of
    the final norm."""
    state = official_state(decoder=False)
    state["head.weight"], state["head.bias"] = torch.randn(10, D), torch.randn(10)
    if fc_norm:
        state["fc_norm.weight"], state["fc_norm.bias"] = state.pop("norm.weight") + 1, state.pop("norm.bias") - 1
    return state


@pytest.mark.parametrize("fc_norm", [True, False])
def test_a_classifier_loads_as_its_encoder_and_says_so(tmp_path, fc_norm):
    state = classifier_state(fc_norm)
    save_file(state, tmp_path / "classifier.safetensors")
    path = tmp_path / "classifier.safetensors"
    with pytest.warns(UserWarning) as caught:
        model = mae.load_pretrained(path, num_heads=HEADS, decoder_num_heads=DHEADS)
    said = [str(w.message) for w in caught if "is a classifier" in str(w.message)]
    note = " and its fc_norm serves as the encoder's final norm" if fc_norm else ""
    assert said == [f"{path} is a classifier: its classifier head is dropped{note}; the encoder is kept"]
    assert [w.filename for w in caught if "is a classifier" in str(w.message)] == [__file__]  # the caller's line
    norm = "fc_norm" if fc_norm else "norm"
    assert torch.equal(model.encoder.norm.weight, state[f"{norm}.weight"])
    assert torch.equal(model.encoder.norm.bias, state[f"{norm}.bias"])
    assert not any("head" in k for k in model.state_dict())
    torch.testing.assert_close(model.encoder.blocks[1].mlp.fc2.weight, state["blocks.1.mlp.fc2.weight"])


def checkpoint(folder, model):
    """A checkpoint as a run writes it: Accelerate's model.safetensors (no metadata) beside config.yaml, whose
    model record alone says what the model is."""
    import json

    import yaml

    from mae.models.spec import SPEC_KEY

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.yaml").write_text(yaml.safe_dump({SPEC_KEY: json.loads(model.spec.to_json())}))
    return folder


def test_a_run_folder_loads_its_latest_checkpoint_by_its_record(tmp_path):
    models = []
    for step in (1, 2, 10):  # step 10 sorts after step 2 by number
        torch.manual_seed(step)
        models.append(mae.create_mae("mae_vit_micro_patch8", img_size=32, decoder_depth=1))
        checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:08d}", models[-1])
    from mae.weights.importers import locate_weights

    path, beside = locate_weights(tmp_path / "run")
    assert path == tmp_path / "run" / "checkpoints" / "step_00000010" / "model.safetensors"
    assert beside == {"spec": models[-1].spec}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = mae.load_pretrained(tmp_path / "run")  # no metadata in the weights: the record in config.yaml
    assert loaded.spec == models[-1].spec
    assert all(torch.equal(v, models[-1].state_dict()[k]) for k, v in loaded.state_dict().items())
    again = mae.load_pretrained(tmp_path / "run" / "checkpoints" / "step_00000002")  # a checkpoint itself
    assert all(torch.equal(v, models[1].state_dict()[k]) for k, v in again.state_dict().items())


def test_a_folder_is_read_by_its_weights_file_name(tmp_path):
    official = official_state()
    (tmp_path / "bin").mkdir()
    torch.save(official, tmp_path / "bin" / "pytorch_model.bin")
    model = mae.load_pretrained(tmp_path / "bin", num_heads=HEADS, decoder_num_heads=DHEADS)
    assert torch.equal(model.encoder.blocks[0].attn.qkv.weight, official["blocks.0.attn.qkv.weight"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as error:
        mae.load_pretrained(tmp_path / "empty")
    assert str(error.value) == (
        f"{tmp_path / 'empty'}: no model.safetensors, encoder.safetensors or pytorch_model.bin in it"
    )
    with pytest.raises(CheckpointError) as error:
        mae.load_pretrained(tmp_path / "missing.pth")
    assert str(error.value) == f"{tmp_path / 'missing.pth'}: no such file or folder"
