"""Decoders behind one call: the paper's and CrossMAE's."""

import pytest
import torch

from mae.models import create_mae
from mae.models.decoder import list_decoders
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
    with pytest.raises(ValueError, match="predict_ratio"):
        create_mae("mae_vit_micro_patch8", decoder="mae", predict_ratio=0.5)
