"""Extension points used from outside the package: a decoder registered here trains, exports and reloads,
and the encoder adapter reports a bare timm ViT's facts."""

import pytest
import timm
import torch
from torch import nn

import mae
from mae.models import check_decoder, encoder_adapter, list_decoders, register_decoder
from mae.weights.export import save_model


@register_decoder("toy")
class LinearDecoder(nn.Module):
    """Per-token linear decoder: visible tokens and a mask token, unshuffled, plus a learned position and the
    average encoder token (the masked patches' only view of the image), to pixels. No attention."""

    def __init__(self, *, grid_size, patch_size, in_chans, embed_dim, num_prefix_tokens, **_):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos = nn.Parameter(torch.zeros(1, grid_size[0] * grid_size[1], embed_dim))
        self.pred = nn.Linear(embed_dim, patch_size**2 * in_chans)

    def forward(self, latent, ids_restore):
        """`latent` [N, P + K, D], `ids_restore` [N, L] -> (pred [N, L, p*p*C], predicted [N, L]: all ones)."""
        x = latent[:, self.num_prefix_tokens :]
        n, length = ids_restore.shape
        x = torch.cat([x, self.mask_token.expand(n, length - x.shape[1], -1)], dim=1)
        x = torch.gather(x, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1])) + self.pos
        x = x + latent.mean(dim=1, keepdim=True)
        return self.pred(x), torch.ones(n, length, device=x.device)


def test_an_outside_decoder_trains_every_parameter_and_the_loss_falls():
    assert "toy" in list_decoders()
    check_decoder("toy", predict_ratio=1.0)  # no options of its own to check
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", decoder="toy").train()
    images, noise = torch.randn(4, 3, 32, 32), torch.rand(4, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(8):
        loss = model(images, noise=noise).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            assert not [n for n, g in grads.items() if g is None or not g.any()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_an_outside_decoder_exports_and_reloads(tmp_path):
    model = mae.create_mae("mae_vit_micro_patch8", decoder="toy").eval()
    path = mae.export_encoder(model, tmp_path / "enc.safetensors")
    vit = mae.load_encoder(path).eval()  # timm loads strictly
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(x), model.encoder.forward_features(x))
    again = mae.load_pretrained(save_model(model, tmp_path / "mae.safetensors")).eval()
    assert again.decoder_name == "toy"
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_decoders_check_their_own_options():
    with pytest.raises(ValueError, match="the mae decoder predicts every masked patch; use --model.decoder cross"):
        check_decoder("mae", predict_ratio=0.5)
    check_decoder("cross", predict_ratio=0.5)
    with pytest.raises(ValueError, match=r"predict_ratio must be in \(0, 1\]"):
        check_decoder("cross", predict_ratio=0)
    with pytest.raises(ValueError, match="unknown decoder 'nope'; choose one of: .*cross, mae"):
        check_decoder("nope")


def test_the_adapter_reports_a_bare_timm_vit():
    """A classifier with register tokens and no class token, as timm builds it: the facts others read."""
    vit = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, num_classes=5, img_size=28,
                            patch_size=7, embed_dim=48, depth=2, num_heads=3, class_token=False,
                            global_pool="avg")  # fmt: skip
    a = encoder_adapter(vit)
    assert (a.num_prefix_tokens, a.has_class_token, a.embed_dim, a.depth, a.num_heads) == (4, False, 48, 2, 3)
    assert (a.patch_size, a.grid_size, a.img_size, a.in_chans) == ((7, 7), (4, 4), (28, 28), 3)
    assert a.describe() == "ViT 48 wide, 2 blocks, patch 7, 28x28"
    arch, args = a.timm_architecture()
    rebuilt = timm.create_model(arch, pretrained=False, num_classes=0, **args)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in vit.state_dict().items() if not k.startswith("head.")
    }
    with pytest.raises(TypeError, match="no encoder adapter drives a Linear"):
        encoder_adapter(nn.Linear(2, 2))
