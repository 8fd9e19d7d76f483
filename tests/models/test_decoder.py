"""Decoders behind one call: the paper's and CrossMAE's."""

import pytest
import torch

from mae.models import create_mae
from mae.models.decoder import CrossAttention, CrossBlock, MAEDecoder, check_decoder, decoder_class, list_decoders
from mae.models.masking import num_visible


def model(decoder="cross", predict_ratio=1.0):
    return create_mae("mae_vit_micro_patch8", decoder=decoder, predict_ratio=predict_ratio).eval()


@pytest.mark.parametrize("decoder", list_decoders())
def test_every_decoder_trains_every_parameter(decoder):
    m = create_mae("mae_vit_micro_patch8", decoder=decoder).train()
    m(torch.randn(2, 3, 32, 32)).loss.backward()
    assert not [n for n, p in m.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_cross_decoder_predicts_the_chosen_fraction_of_masked_patches(ratio):
    m = model(predict_ratio=ratio)
    x, noise = torch.randn(3, 3, 32, 32), torch.rand(3, 16)
    latent, masking = m.forward_encoder(x, 0.75, noise)
    pred, predicted = m.decoder(latent, masking.ids_restore)
    count = round(ratio * (16 - num_visible(16, 0.75)))
    assert (predicted.sum(1) == count).all()
    assert (predicted <= masking.mask).all()  # only masked patches are predicted
    assert (pred[predicted == 0] == 0).all()
    # the first `count` masked patches in the masking's own (random) order
    order = torch.argsort(masking.ids_restore, dim=1)[:, 4 : 4 + count]
    assert all(set(order[i].tolist()) == set(predicted[i].nonzero().flatten().tolist()) for i in range(3))


def test_cross_decoder_queries_do_not_see_each_other():
    """A patch's prediction is the same whichever other masked patches are predicted beside it."""
    few, every = model(predict_ratio=0.25), model(predict_ratio=1.0)
    every.load_state_dict(few.state_dict())
    x, noise = torch.randn(2, 3, 32, 32), torch.rand(2, 16)
    with torch.no_grad():
        latent, masking = few.forward_encoder(x, 0.75, noise)
        a, pa = few.decoder(latent, masking.ids_restore)
        b, _ = every.decoder(latent, masking.ids_restore)
    torch.testing.assert_close(a[pa == 1], b[pa == 1])


def test_the_loss_covers_exactly_the_predicted_patches():
    m = model(predict_ratio=0.5)
    x, noise = torch.randn(2, 3, 32, 32), torch.rand(2, 16)
    with torch.no_grad():
        out = m(x, noise=noise)
        latent, masking = m.forward_encoder(x, 0.75, noise)
        _, predicted = m.decoder(latent, masking.ids_restore)
    target = m.forward_target(x)
    per_patch = (out.pred - target).pow(2).mean(-1)
    torch.testing.assert_close(out.loss, (per_patch * predicted).sum() / predicted.sum())


def test_the_mae_decoder_refuses_a_prediction_ratio():
    with pytest.raises(ValueError, match="predict_ratio") as error:
        create_mae("mae_vit_micro_patch8", decoder="mae", predict_ratio=0.5)
    assert str(error.value) == (
        "predict_ratio 0.5: the mae decoder predicts every masked patch; "
        "use --model.decoder cross to predict a fraction of them"
    )


def test_decoder_options_are_checked_by_name_before_a_model_is_built():
    names = (
        list_decoders()
    )  # the built-ins, and any a plug-in test of this worker registered (tests/models/test_extension.py)
    assert {"cross", "mae"} <= set(names) and names == sorted(names)
    check_decoder("mae")  # the defaults pass
    check_decoder("cross")
    check_decoder("cross", predict_ratio=1.0)
    check_decoder("mae", predict_ratio=1)
    for ratio in (0, -0.5, 1.5, 2.0):
        with pytest.raises(ValueError) as error:
            check_decoder("cross", predict_ratio=ratio)
        assert str(error.value) == f"predict_ratio must be in (0, 1], got {ratio}"
    with pytest.raises(ValueError, match="^predict_ratio 0.5: the mae decoder predicts every masked patch"):
        check_decoder("mae", predict_ratio=0.5)
    with pytest.raises(ValueError) as error:
        decoder_class("crossmae")
    assert str(error.value) == f"unknown decoder 'crossmae'; choose one of: {', '.join(names)}"


def test_a_decoder_built_from_its_grid_alone_is_the_papers():
    """The defaults are the official MAE's decoder for ViT-B: 768 in, 512 wide, 8 blocks of 16 heads, MLP 4x, RGB,
    one cls token; its LayerNorms take eps 1e-6, its attention a qkv bias (as the official weights have)."""
    dec = MAEDecoder(grid_size=(2, 3), patch_size=4)
    assert (dec.embed.in_features, dec.embed.out_features, len(dec.blocks), dec.num_heads) == (768, 512, 8, 16)
    assert (dec.num_prefix_tokens, dec.predict_ratio, dec.pred.out_features) == (1, 1.0, 4 * 4 * 3)
    assert dec.blocks[0].mlp.fc1.out_features == 2048 and dec.blocks[0].attn.num_heads == 16
    assert all(b.attn.qkv.bias is not None for b in dec.blocks)
    assert not dec.pos_embed.requires_grad  # fixed by the decoder itself, not only by the MAE that holds it
    norms = [m for m in dec.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 17 and all(m.eps == 1e-6 for m in norms)
    assert dec(torch.randn(2, 1 + 2, 768), torch.randperm(6).repeat(2, 1))[0].shape == (2, 6, 48)


@pytest.mark.parametrize("decoder", ["mae", "cross"])
def test_the_position_table_is_fixed_and_the_mask_token_shared(decoder):
    """The official layout: a [1, 1 + L, D] sine-cosine table that never trains, one [1, 1, D] mask token."""
    m = model(decoder)
    assert m.decoder.pos_embed.shape == (1, 17, 64) and not m.decoder.pos_embed.requires_grad
    assert m.decoder.mask_token.shape == (1, 1, 64)
    x = torch.randn(3, 3, 32, 32)  # three images: no layout that only fits a batch of 1 or 2
    with torch.no_grad():
        latent, masking = m.forward_encoder(x, 0.75, torch.rand(3, 16))
        pred, _ = m.decoder(latent, masking.ids_restore)
    assert pred.shape == (3, 16, 8 * 8 * 3)
    if decoder == "cross":
        norms = [mod for mod in m.decoder.modules() if isinstance(mod, torch.nn.LayerNorm)]
        assert len(norms) == 1 + 3 * len(m.decoder.blocks) and all(mod.eps == 1e-6 for mod in norms)


def reference_attention(attn: CrossAttention, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """Multi-head cross-attention written head by head: keys are the first half of `kv`'s outputs, values the
    second; each head's queries, keys and values a contiguous slice of the width; scaled by 1 / sqrt(head width)."""
    d, h = x.shape[-1], attn.num_heads
    q, kv = attn.q(x), attn.kv(context)
    k, v = kv[..., :d], kv[..., d:]
    heads = []
    for i in range(h):
        part = slice(i * d // h, (i + 1) * d // h)
        weights = torch.softmax(q[..., part] @ k[..., part].transpose(1, 2) / (d // h) ** 0.5, dim=-1)
        heads.append(weights @ v[..., part])
    return attn.proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("fused", [True, False])
def test_cross_attention_is_multi_head_attention_over_the_context(fused):
    torch.manual_seed(0)
    attn = CrossAttention(12, 3)
    attn.fused_attn = fused  # --loop.attention math takes the explicit path
    x, context = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, context), reference_attention(attn, x, context))
    with pytest.raises(ValueError) as error:
        CrossAttention(10, 3)
    assert str(error.value) == "decoder width 10 is not a multiple of its head count 3"


def test_a_cross_block_is_pre_norm_attention_then_mlp_each_residual():
    torch.manual_seed(0)
    block = CrossBlock(8, 2, mlp_ratio=4.0)
    assert block.mlp.fc1.out_features == 32 and all(
        n.eps == 1e-6 for n in (block.norm1, block.norm_context, block.norm2)
    )
    for norm in (block.norm1, block.norm_context, block.norm2):  # distinct norms, so a swap shows
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    x, context = torch.randn(2, 3, 8), torch.randn(2, 6, 8)
    with torch.no_grad():
        mid = x + reference_attention(block.attn, block.norm1(x), block.norm_context(context))
        torch.testing.assert_close(block(x, context), mid + block.mlp(block.norm2(mid)))


def test_the_cross_decoder_is_its_blocks_over_positioned_queries_and_context():
    """Per sample, by hand: the context is the embedded encoder tokens, each visible patch plus its position
    (prefix tokens as they are); each query is the mask token plus its patch's position; after the blocks, the
    norm and the head, a prediction lands on its patch."""
    m = model(predict_ratio=0.5)
    dec = m.decoder
    torch.nn.init.normal_(dec.mask_token)
    x, noise = torch.randn(2, 3, 32, 32), torch.rand(2, 16)
    with torch.no_grad():
        latent, masking = m.forward_encoder(x, 0.75, noise)
        pred, predicted = dec(latent, masking.ids_restore)
        pos = dec.pos_embed[0, 1:]
        for i in range(2):
            order = torch.argsort(masking.ids_restore[i])
            visible, chosen = order[:4], order[4:10]  # 12 masked, half of them predicted
            context = dec.embed(latent[i : i + 1])
            context = torch.cat([context[:, :1], context[:, 1:] + pos[visible]], dim=1)
            q = dec.mask_token + pos[chosen]
            for block in dec.blocks:
                q = block(q, context)
            torch.testing.assert_close(pred[i, chosen], dec.pred(dec.norm(q))[0])
            assert predicted[i].nonzero().flatten().tolist() == sorted(chosen.tolist())


def test_a_tiny_prediction_ratio_still_predicts_one_patch():
    m = model(predict_ratio=0.05)  # 0.05 x 12 masked patches rounds to 1
    with torch.no_grad():
        latent, masking = m.forward_encoder(torch.randn(2, 3, 32, 32), 0.75, torch.rand(2, 16))
        _, predicted = m.decoder(latent, masking.ids_restore)
    assert predicted.sum(1).tolist() == [1.0, 1.0]
    m = model(predict_ratio=0.01)  # rounds to 0: one all the same
    with torch.no_grad():
        _, predicted = m.decoder(latent, masking.ids_restore)
    assert predicted.sum(1).tolist() == [1.0, 1.0]


def test_the_mae_decoder_is_its_blocks_over_every_patch_in_place():
    """Per sample, by hand: patch j takes its encoder token if visible (the mask token if not), plus position j;
    the prefix token takes the table's first row; all go through the blocks, the norm and the head."""
    m = model("mae")
    dec = m.decoder
    torch.nn.init.normal_(dec.mask_token)
    with torch.no_grad():
        dec.pos_embed[:, 0].normal_()  # a nonzero first row, so that its use shows
        latent, masking = m.forward_encoder(torch.randn(2, 3, 32, 32), 0.75, torch.rand(2, 16))
        pred, predicted = dec(latent, masking.ids_restore)
        for i in range(2):
            x = dec.embed(latent[i])
            visible = torch.argsort(masking.ids_restore[i])[:4]
            patches = dec.mask_token[0].repeat(16, 1)
            patches[visible] = x[1:]
            tokens = torch.cat([x[:1] + dec.pos_embed[0, :1], patches + dec.pos_embed[0, 1:]])
            torch.testing.assert_close(pred[i], dec.pred(dec.norm(dec.blocks(tokens[None])))[0, 1:])
    assert predicted.shape == (2, 16) and (predicted == 1).all()
