"""transformers' ViTMAEForPreTraining is the public reference formulation."""

import pytest
import torch
import transformers  # a dev dependency (the parity reference): missing, the suite fails rather than skips

from mae.models import create_mae
from mae.weights.importers import hf_vitmae_to_mae, mae_to_hf_vitmae

ARCH = dict(
    img_size=32,
    patch_size=8,
    embed_dim=64,
    depth=2,
    num_heads=2,
    decoder_embed_dim=32,
    decoder_depth=2,
    decoder_num_heads=2,
)


def _hf_model(norm_pix_loss=True):
    cfg = transformers.ViTMAEConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        decoder_hidden_size=32,
        decoder_num_hidden_layers=2,
        decoder_num_attention_heads=2,
        decoder_intermediate_size=128,
        layer_norm_eps=1e-6,
        mask_ratio=0.75,
        norm_pix_loss=norm_pix_loss,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    return transformers.ViTMAEForPreTraining(cfg).eval()


@pytest.mark.parametrize("norm_pix_loss", [True, False])
def test_ours_in_transformers_gives_same_loss_and_pred(norm_pix_loss):
    ours = create_mae("mae_vit_micro_patch8", norm_pix_loss=norm_pix_loss, **ARCH).eval()
    hf = _hf_model(norm_pix_loss)
    hf.load_state_dict(mae_to_hf_vitmae(ours.state_dict()), strict=True)
    imgs = torch.randn(4, 3, 32, 32)
    noise = torch.rand(4, 16)
    with torch.no_grad():
        a = ours(imgs, noise=noise)
        b = hf(pixel_values=imgs, noise=noise)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.ids_restore, b.ids_restore)
    torch.testing.assert_close(a.pred, b.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_transformers_weights_in_ours_round_trip():
    hf = _hf_model()
    with torch.no_grad():  # give every tensor distinct values (transformers zeroes some at init)
        for p in hf.parameters():
            p.normal_(0, 0.05)
    ours = create_mae("mae_vit_micro_patch8", **ARCH).eval()
    ours.load_state_dict(hf_vitmae_to_mae(hf.state_dict()), strict=True)
    imgs, noise = torch.randn(2, 3, 32, 32), torch.rand(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(imgs, noise=noise).loss, hf(pixel_values=imgs, noise=noise).loss)
    back = mae_to_hf_vitmae(ours.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_transformers_sincos_layout_equals_ours():
    # transformers builds the canonical [h | w] table, then swaps the halves back to the
    # official [w | h] order, which is ours.
    hf = _hf_model()
    hf.vit.embeddings.patch_embeddings.projection._is_hf_initialized = False
    hf.vit.embeddings.initialize_weights()
    hf.decoder.initialize_weights(16)
    ours = create_mae("mae_vit_micro_patch8", **ARCH)
    assert torch.allclose(hf.vit.embeddings.position_embeddings, ours.encoder.pos_embed, atol=1e-6)
    assert torch.allclose(hf.decoder.decoder_pos_embed, ours.decoder.pos_embed, atol=1e-6)
