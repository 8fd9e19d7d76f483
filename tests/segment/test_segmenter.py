"""mae.models.segmenter in process: each head's shape and layers, the frozen probe and the fine-tuned encoder, the
patch tokens as a grid (prefix tokens dropped, any size), layer-decay groups, and sliding-window inference against
plain resizing."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from mae.models.segmenter import (
    HEADS,
    LinearHead,
    ProgressiveHead,
    Segmenter,
    linear_head,
    list_heads,
    progressive_head,
    register_head,
    sliding_window,
    window_starts,
)


def encoder(reg_tokens=0, img_size=(32, 48)):
    return timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=img_size, patch_size=8, depth=2,
                             reg_tokens=reg_tokens, class_token=True)  # fmt: skip


def test_the_linear_head_is_batch_norm_a_1x1_conv_and_bilinear_upsampling():
    torch.manual_seed(0)
    head = linear_head(16, 5, 8)
    assert isinstance(head, LinearHead) and head.classifier.kernel_size == (1, 1)
    weight = head.classifier.weight.detach()
    assert torch.equal(head.classifier.bias, torch.zeros(5)) and 0.005 < float(weight.std()) < 0.015
    tokens = torch.randn(2, 16, 3, 4)
    head.eval()
    with torch.no_grad():
        head.norm.running_mean.copy_(torch.randn(16))
        head.norm.running_var.copy_(torch.rand(16) + 0.5)
        normed = (tokens - head.norm.running_mean.view(1, -1, 1, 1)) / (head.norm.running_var + 1e-5).sqrt().view(
            1, -1, 1, 1
        ) * head.norm.weight.view(1, -1, 1, 1) + head.norm.bias.view(1, -1, 1, 1)
        grid = torch.einsum("ndhw,kd->nkhw", normed, head.classifier.weight[:, :, 0, 0]) + head.classifier.bias.view(
            1, -1, 1, 1
        )
        want = F.interpolate(grid, size=(24, 32), mode="bilinear", align_corners=False)
        torch.testing.assert_close(head(tokens, (24, 32)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "patch,stages,widths",
    [(8, 2, [128, 64, 32]), (16, 3, [128, 64, 32, 32]), (2, 1, [128, 64]), (14, 3, [128, 64, 32, 32])],
)
def test_the_progressive_head_doubles_up_to_half_the_image(patch, stages, widths):
    """One 2x stage per factor 2 of the patch size but the last (at least one), each halving the width down to 32;
    conv + batch norm + ReLU blocks; the logits resized to the image only where the stages fall short of it."""
    torch.manual_seed(0)
    head = progressive_head(24, 3, patch)
    assert isinstance(head, ProgressiveHead) and len(head.ups) == stages
    blocks = [head.stem, *head.ups]
    assert [b[0].in_channels for b in blocks] == [24, *widths[:-1]]
    assert [b[0].out_channels for b in blocks] == widths and head.classifier.in_channels == widths[-1]
    for b in blocks:
        assert b[0].kernel_size == (3, 3) and b[0].padding == (1, 1) and b[0].bias is None
        assert isinstance(b[1], nn.BatchNorm2d) and isinstance(b[2], nn.ReLU)
    head.eval()
    tokens = torch.randn(2, 24, 3, 5)
    with torch.no_grad():
        x = head.stem(tokens)
        for up in head.ups:
            x = up(F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False))
        native = (3 * 2**stages, 5 * 2**stages)
        assert torch.equal(head(tokens, native), head.classifier(x))  # no resize at the stages' own size
        image = (3 * patch, 5 * patch)
        want = F.interpolate(head.classifier(x), size=image, mode="bilinear", align_corners=False)
        torch.testing.assert_close(head(tokens, image), want)


def test_the_patch_tokens_as_a_grid_without_prefix_tokens():
    """Grid cell (i, j) holds the token of patch i * gw + j after the class and register tokens, on non-square
    images; the sizes the segmenter reports are the encoder's."""
    torch.manual_seed(0)
    enc = encoder(reg_tokens=2).eval()
    model = Segmenter(enc, linear_head(192, 3, 8), frozen_encoder=True)
    assert model.patch_size == (8, 8) and model.img_size == (32, 48)
    x = torch.randn(2, 3, 32, 48)
    grid = model.forward_features(x)
    tokens = enc.forward_features(x)
    assert grid.shape == (2, 192, 4, 6) and enc.num_prefix_tokens == 3
    for i, j in ((0, 0), (1, 4), (3, 5)):
        assert torch.equal(grid[:, :, i, j], tokens[:, 3 + i * 6 + j])


def test_a_frozen_encoder_gets_no_gradient_and_stays_in_eval_mode():
    torch.manual_seed(0)
    model = Segmenter(encoder(), linear_head(192, 3, 8), frozen_encoder=True)
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert model.train() is model and not model.encoder.training and model.head.training
    x = torch.randn(2, 3, 32, 48)
    model(x).square().mean().backward()
    assert all(p.grad is None for p in model.encoder.parameters()) and model.head.classifier.weight.grad is not None
    assert not model.forward_features(x).requires_grad


def test_a_fine_tuned_encoder_trains_with_its_head():
    torch.manual_seed(0)
    model = Segmenter(encoder(), progressive_head(192, 3, 8), frozen_encoder=False)
    assert model.train() is model and model.encoder.training and model.head.training
    model.eval()
    assert not model.encoder.training and not model.head.training
    model.train()
    x = torch.randn(2, 3, 32, 48)
    out = model(x)
    assert out.shape == (2, 3, 32, 48)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.encoder.blocks.parameters())
    assert not model.segment(x).requires_grad  # inference builds no graph


def test_layer_decay_groups_are_the_encoders_under_its_prefix_and_the_head_last():
    from timm.models import group_parameters

    model = Segmenter(encoder(), linear_head(192, 3, 8), frozen_encoder=False)
    groups = group_parameters(model, model.group_matcher(coarse=False))
    group_of = {name: gid for gid, names in groups.items() for name in names}
    assert {group_of[n] for n in ("encoder.cls_token", "encoder.pos_embed", "encoder.patch_embed.proj.weight")} == {0}
    assert group_of["encoder.blocks.0.attn.qkv.weight"] == 1 and group_of["encoder.blocks.1.mlp.fc2.bias"] == 2
    assert group_of["encoder.norm.weight"] == 2  # timm's rule: the final norm joins the last block
    assert group_of["head.classifier.weight"] == max(groups) == 3  # matched by none: a group of its own, last
    assert model.no_weight_decay() == {f"encoder.{n}" for n in model.encoder.no_weight_decay()}
    assert "encoder.pos_embed" in model.no_weight_decay()


def test_a_head_registered_from_outside_is_a_choice():
    @register_head("test_identity", trains_encoder=True, description="the tokens' first channels, upsampled")
    def identity(embed_dim, num_classes, patch_size):
        return LinearHead(embed_dim, num_classes)

    try:
        kind = HEADS.get("test_identity")
        assert "test_identity" in list_heads() and kind.trains_encoder and kind.build is identity
        assert kind.description == "the tokens' first channels, upsampled"
        assert not HEADS.get("linear").trains_encoder and HEADS.get("progressive").trains_encoder
    finally:
        HEADS.unregister("test_identity")
    assert list_heads() == ["linear", "progressive"]


class Identity(nn.Module):
    """Logits = the window itself: sliding-window inference must give the image back, only resampled."""

    def forward(self, x):
        return x * 1.0


@pytest.mark.parametrize("size,scaled", [((20, 30), (32, 48)), ((64, 96), (32, 48)), ((32, 100), (32, 100)),
                                         ((50, 40), (40, 32))])  # fmt: skip
def test_the_sliding_window_gives_back_what_a_position_free_model_sees(size, scaled):
    """The image is rescaled to just cover the window (antialiased), windows overlap by a third and are averaged,
    and the logits are resized back: with logits = the window, that is the rescaled image resized back."""
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    got = sliding_window(Identity(), x, (32, 32))
    want = x if scaled == size else F.interpolate(x, size=scaled, mode="bilinear", align_corners=False, antialias=True)
    if scaled != size:
        want = F.interpolate(want, size=size, mode="bilinear", align_corners=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert window_starts(scaled[1], 32) == sorted(set(window_starts(scaled[1], 32)))


def test_window_starts_stride_is_two_thirds_of_the_window_at_least_one():
    assert window_starts(5, 1) == [0, 1, 2, 3, 4]
    assert window_starts(10, 3) == [0, 2, 4, 6, 7]
    for window in (2, 9, 32):
        starts = window_starts(4 * window, window)
        assert starts[1] - starts[0] == max(1, window * 2 // 3) and starts[-1] == 3 * window


def test_head_kinds_are_fixed_and_an_unknown_one_is_named():
    import dataclasses

    kind = HEADS.get("linear")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kind.trains_encoder = True
    with pytest.raises(ValueError, match=r"unknown segmentation head 'upernet'; choose one of: linear, progressive"):
        HEADS.get("upernet")


class Bare(nn.Module):
    """An encoder that says nothing of its prefix tokens: one class token is assumed."""

    def __init__(self, vit):
        super().__init__()
        self.vit, self.patch_embed = vit, vit.patch_embed

    def forward_features(self, x):
        return self.vit.forward_features(x)


def test_tokens_of_non_square_patches_and_of_an_encoder_without_a_prefix_count():
    torch.manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224", num_classes=0, img_size=(32, 48), patch_size=(8, 16), depth=1
    ).eval()
    model = Segmenter(vit, linear_head(192, 2, 8), frozen_encoder=True)
    x = torch.randn(1, 3, 32, 48)
    grid = model.forward_features(x)
    assert model.patch_size == (8, 16) and grid.shape == (1, 192, 4, 3)
    assert torch.equal(grid[0, :, 2, 1], vit.forward_features(x)[0, 1 + 2 * 3 + 1])
    bare = Segmenter(Bare(encoder(reg_tokens=0)).eval(), linear_head(192, 2, 8), frozen_encoder=True)
    x = torch.randn(1, 3, 32, 48)
    assert torch.equal(bare.forward_features(x).flatten(2).transpose(1, 2), bare.encoder.vit.forward_features(x)[:, 1:])


def test_no_graph_under_no_grad():
    model = Segmenter(encoder(), progressive_head(192, 3, 8), frozen_encoder=False)
    with torch.no_grad():
        assert not model.forward_features(torch.randn(1, 3, 32, 48)).requires_grad
