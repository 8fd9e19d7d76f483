import pytest
import torch

from mae.models import create_mae, list_presets


@pytest.fixture
def model():
    return create_mae("mae_vit_micro_patch8").eval()


def test_unmasked_encoder_is_the_timm_vit(model):
    imgs = torch.randn(2, 3, 32, 32)
    identity = torch.arange(model.num_patches, dtype=torch.float32).expand(2, -1)
    latent, masking = model.forward_encoder(imgs, 0.0, identity)
    assert masking.mask.sum() == 0
    torch.testing.assert_close(latent, model.encoder.forward_features(imgs), rtol=1e-5, atol=1e-5)


def test_masking_only_drops_tokens(model):
    # Running the ViT on cls + exactly the kept patches (each with its own position embedding)
    # gives the masked encoder's output: masking removes tokens and changes nothing else.
    enc = model.encoder
    imgs = torch.randn(3, 3, 32, 32)
    noise = torch.rand(3, model.num_patches)
    latent, masking = model.forward_encoder(imgs, 0.75, noise)
    for i in range(3):
        tokens = enc.patch_embed(imgs[i : i + 1])[0] + enc.pos_embed[0, 1:]
        kept = tokens[masking.ids_keep[i]]
        x = torch.cat([enc.cls_token[0] + enc.pos_embed[0, :1], kept]).unsqueeze(0)
        for blk in enc.blocks:
            x = blk(x)
        torch.testing.assert_close(latent[i : i + 1], enc.norm(x), rtol=1e-5, atol=1e-5)
        # and the kept patches are the ones the mask marks visible
        assert torch.equal(
            masking.mask[i].nonzero().flatten().sort().values,
            torch.tensor(sorted(set(range(16)) - set(masking.ids_keep[i].tolist()))),
        )


def test_loss_ignores_visible_predictions(model):
    imgs = torch.randn(2, 3, 32, 32)
    out = model(imgs, noise=torch.rand(2, model.num_patches))
    visible = (out.mask == 0).nonzero()[0]
    masked = (out.mask == 1).nonzero()[0]
    pred = out.pred.detach().clone()
    pred[visible[0], visible[1]] += 100.0
    assert torch.equal(model.forward_loss(imgs, pred, out.mask), out.loss.detach())
    pred[masked[0], masked[1]] += 1.0
    assert not torch.allclose(model.forward_loss(imgs, pred, out.mask), out.loss.detach())


def test_loss_matches_formula(model):
    imgs = torch.randn(2, 3, 32, 32)
    out = model(imgs)
    target = model.patchify(imgs)
    for norm_pix in (True, False):
        model.norm_pix_loss = norm_pix
        t = (
            (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
            if norm_pix
            else target
        )
        per_patch = ((out.pred - t) ** 2).mean(-1)
        expected = per_patch[out.mask.bool()].mean()
        torch.testing.assert_close(model.forward_loss(imgs, out.pred, out.mask), expected)


def test_normalised_target_adds_its_epsilon_to_the_variance(model):
    # Flat patches (a blank background) have variance 0: the reference's 1e-6 added to it keeps their target 0,
    # not NaN; on patches of variance 1e-6 the epsilon halves the normalised values' square (where randn data
    # cannot tell the sign of the epsilon from rounding).
    model.norm_pix_loss = True
    flat = torch.full((1, 3, 32, 32), 0.25)
    assert torch.equal(model.forward_target(flat), torch.zeros_like(model.patchify(flat)))
    faint = 0.5 + 1e-3 * torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    t = model.patchify(faint)
    var = t.var(-1, keepdim=True)
    torch.testing.assert_close(model.forward_target(faint), (t - t.mean(-1, keepdim=True)) / (var + 1e-6).sqrt())
    assert model.forward_target(faint).pow(2).mean() < 0.6  # about 1/2; without the epsilon it would be about 1


def test_same_seed_same_loss_and_noise_determines_mask():
    imgs = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    a = create_mae("mae_vit_micro_patch8")(imgs)
    torch.manual_seed(1)
    b = create_mae("mae_vit_micro_patch8")(imgs)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.mask, b.mask)
    model = create_mae("mae_vit_micro_patch8")
    noise = torch.rand(2, 16)
    torch.manual_seed(5)
    c = model(imgs, noise=noise)
    torch.manual_seed(6)
    d = model(imgs, noise=noise)
    assert torch.equal(c.mask, d.mask) and torch.equal(c.loss, d.loss)


@pytest.mark.parametrize("img_size", [(32, 48), (48, 32)])
def test_non_square_end_to_end(img_size):
    model = create_mae("mae_vit_micro_patch8", img_size=img_size)
    imgs = torch.randn(2, 3, *img_size)
    out = model(imgs)
    length = (img_size[0] // 8) * (img_size[1] // 8)
    assert out.pred.shape == (2, length, 8 * 8 * 3) and out.mask.shape == (2, length)
    assert model.unpatchify(out.pred).shape == imgs.shape
    out.loss.backward()


def test_init_follows_official_recipe(model):
    blk = model.encoder.blocks[0]
    w = blk.attn.qkv.weight
    bound = (6 / (w.shape[0] + w.shape[1])) ** 0.5  # xavier-uniform
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.count_nonzero(blk.attn.qkv.bias) == 0
    pw = model.encoder.patch_embed.proj.weight
    pbound = (6 / (pw.shape[0] + pw[0].numel())) ** 0.5
    assert pw.abs().max() <= pbound and pw.abs().max() > 0.9 * pbound
    assert torch.equal(blk.norm1.weight, torch.ones_like(blk.norm1.weight))
    big = create_mae("mae_vit_base_patch16")
    for tok in (big.encoder.cls_token, big.decoder.mask_token):
        assert abs(tok.std().item() - 0.02) < 0.003


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_gets_finite_gradients(name):
    model = create_mae(name, img_size=32, patch_size=8, depth=2, decoder_depth=1)
    out = model(torch.randn(2, 3, 32, 32))
    out.loss.backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, pname
            assert torch.isfinite(p.grad).all(), pname
            assert p.grad.abs().sum() > 0, pname
        else:
            assert pname.endswith("pos_embed"), pname


def test_presets_match_paper_shapes():
    base = create_mae("mae_vit_base_patch16_dec512d8b", depth=1, decoder_depth=1)
    assert base.encoder.embed_dim == 768 and base.decoder.embed.out_features == 512
    assert create_mae("mae_vit_huge_patch14", depth=1, decoder_depth=1).patch_size == 14


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="unknown preset 'mae_vit_gigantic'"):
        create_mae("mae_vit_gigantic")
    with pytest.raises(TypeError, match="unknown override"):
        create_mae("mae_vit_micro_patch8", embed_dims=64)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        create_mae("mae_vit_micro_patch8", img_size=30)
    with pytest.raises(ValueError, match="mask_ratio"):
        create_mae("mae_vit_micro_patch8", mask_ratio=1.0)
