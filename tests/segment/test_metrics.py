"""Segmentation metrics against a brute-force count, and the sliding window against a direct pass."""

from __future__ import annotations

import pytest
import timm
import torch

from mae.models.segmenter import Segmenter, linear_head, sliding_window, window_starts
from mae.train.segment_task import confusion_matrix, segmentation_scores


def brute_force(pred, target, k, ignore=255):
    """IoU per class and pixel accuracy by counting pixels one by one."""
    pairs = [(int(p), int(t)) for p, t in zip(pred.flatten(), target.flatten(), strict=True) if int(t) != ignore]
    iou = []
    for c in range(k):
        inter = sum(1 for p, t in pairs if p == c and t == c)
        union = sum(1 for p, t in pairs if p == c or t == c)
        iou.append(100.0 * inter / union if union else None)
    present = [v for v in iou if v is not None]
    return sum(present) / len(present), 100.0 * sum(1 for p, t in pairs if p == t) / len(pairs), iou


@pytest.mark.parametrize("seed", range(4))
def test_miou_pixel_accuracy_and_per_class_iou_match_a_brute_force_count_with_an_ignore_index(seed):
    g = torch.Generator().manual_seed(seed)
    k = 5
    target = torch.randint(0, k - 1, (3, 9, 11), generator=g)  # class 4 never in the targets
    target[torch.rand(target.shape, generator=g) < 0.3] = 255
    pred = torch.randint(0, k, target.shape, generator=g)
    pred[0, 0, 0] = 4
    if seed == 0:
        pred[pred == 4] = 3  # class 4 neither seen nor predicted: left out of the mean
    miou, acc, iou = brute_force(pred, target, k)
    scores = segmentation_scores(confusion_matrix(pred, target, k))
    assert scores["miou"] == pytest.approx(miou, abs=1e-9) and scores["pixel_acc"] == pytest.approx(acc, abs=1e-9)
    assert scores["per_class_iou"] == pytest.approx(iou, abs=1e-9)
    assert (scores["per_class_iou"][4] is None) == (seed == 0)
    changed = pred.clone()
    changed[target == 255] = (changed[target == 255] + 1) % k  # predictions at ignored pixels count for nothing
    assert segmentation_scores(confusion_matrix(changed, target, k)) == scores


def test_window_starts_cover_the_axis_with_overlap():
    assert window_starts(32, 32) == [0]
    assert window_starts(80, 32) == [0, 21, 42, 48]
    for length in range(32, 100):
        starts = window_starts(length, 32)
        covered = torch.zeros(length, dtype=torch.bool)
        for s in starts:
            covered[s : s + 32] = True
        assert covered.all() and starts[-1] == length - 32


def test_the_sliding_window_is_one_pass_at_the_input_size_and_averages_overlaps_elsewhere():
    encoder = timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, depth=1)
    model = Segmenter(encoder, linear_head(192, 3, 8), frozen_encoder=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(sliding_window(model, x, (32, 32)), model(x))
        wide = torch.randn(1, 3, 32, 80)  # covers the window at scale 1: three windows, logits averaged
        out = sliding_window(model, wide, (32, 32))
        assert out.shape == (1, 3, 32, 80)
        assert torch.allclose(out[..., :21], model(wide[..., :32])[..., :21], atol=1e-6)  # one window only there
        small = torch.randn(1, 3, 20, 30)  # scaled up to cover the window, then back
        assert model.segment(small).shape == (1, 3, 20, 30)
