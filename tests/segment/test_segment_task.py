"""Segmentation's evaluation and loss in process: every image scored at its own size against a count made by hand,
the loss averaged over labeled pixels only, unreadable files reported, the model's mode restored."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from mae.train.segment_task import SegmentTask, evaluate_segmenter, same_size_groups, segmentation_scores


class Channels(nn.Module):
    """`segment` = the image's first 3 channels as 3-class logits, through an identity 1x1 convolution (which autocast
    would round), any size; `forward` the same (training). Evaluation must call it in eval mode without a graph."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.conv.bias.zero_()

    def forward(self, x):
        return self.conv(x[:, :3])

    def segment(self, x):
        assert not self.training and not torch.is_grad_enabled()
        return self.forward(x)


def batches():
    g = torch.Generator().manual_seed(0)

    def item(h, w):
        mask = torch.randint(0, 3, (h, w), generator=g)
        mask[0, :2] = 255  # ignored pixels
        return torch.randn(3, h, w, generator=g), mask

    a, b, c, d = item(4, 6), item(4, 6), item(5, 3), item(4, 6)
    stacked = {"image": torch.stack([a[0], b[0]]), "mask": torch.stack([a[1], b[1]]), "bad": []}
    mixed = {"image": [c[0], d[0], d[0]], "mask": [c[1], d[1], d[1]], "bad": [("x.png", "OSError: broken")]}
    empty = {"image": None, "mask": None, "bad": [("y.png", "OSError: empty")]}
    return [stacked, empty, mixed], [a, b, c, d, d]  # a batch of unreadable files between two others


def by_hand(items, k=3):
    confusion, loss, pixels = torch.zeros(k, k, dtype=torch.long), 0.0, 0
    for image, mask in items:
        pred = image[:3].argmax(0)
        for t, p in zip(mask.flatten().tolist(), pred.flatten().tolist(), strict=True):
            if t != 255:
                confusion[t, p] += 1
                pixels += 1
        keep = mask != 255
        loss -= float(torch.log_softmax(image[:3], 0).gather(0, mask.clamp(max=2)[None])[0][keep].double().sum())
    return confusion, loss / pixels


def test_every_image_is_scored_at_its_own_size_against_a_count_by_hand():
    loader, items = batches()
    model = Channels().train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = evaluate_segmenter(model, loader, 3)  # no accelerator: nothing reported, nothing reduced
    confusion, loss = by_hand(items)
    assert result["samples"] == 5 and model.training
    assert {k: result[k] for k in ("miou", "pixel_acc", "per_class_iou")} == segmentation_scores(confusion)
    assert math.isclose(result["loss"], loss, rel_tol=1e-6)


def test_with_an_accelerator_unreadable_files_are_reported_once_each():
    from accelerate import Accelerator

    loader, items = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = evaluate_segmenter(Channels().eval(), loader, 3, Accelerator(cpu=True))
    said = sorted(str(w.message) for w in caught if "unreadable" in str(w.message))
    assert said == [
        "skipping unreadable image x.png: OSError: broken",
        "skipping unreadable image y.png: OSError: empty",
    ]
    assert result["samples"] == 5 and math.isclose(result["loss"], by_hand(items)[1], rel_tol=1e-6)
    nothing = evaluate_segmenter(Channels(), [], 3)
    assert nothing["samples"] == 0 and math.isnan(nothing["loss"]) and math.isnan(nothing["miou"])


def test_same_size_groups_are_runs_of_one_size():
    sizes = [(2, 2), (2, 2), (3, 2), (2, 2), (2, 2), (2, 2)]
    images = [torch.full((1, *s), float(i)) for i, s in enumerate(sizes)]
    masks = [torch.full(s, i) for i, s in enumerate(sizes)]
    groups = list(same_size_groups(images, masks))
    assert [g[0][:, 0, 0, 0].tolist() for g in groups] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]]
    assert [g[1][:, 0, 0].tolist() for g in groups] == [[0, 1], [2], [3, 4, 5]]
    stacked = torch.zeros(2, 1, 2, 2)
    assert [g[0] is stacked for g in same_size_groups(stacked, torch.zeros(2, 2, 2))] == [True]


def test_the_training_loss_ignores_the_ignore_index_and_evaluate_keeps_the_last():
    from accelerate import Accelerator

    model = Channels()
    image = torch.randn(2, 3, 4, 4)
    mask = torch.randint(0, 3, (2, 4, 4))
    mask[:, 0] = 255
    task = SegmentTask(model, accelerator=Accelerator(cpu=True), val_loader=batches()[0][:1], num_classes=3)
    loss = task.forward({"image": image, "mask": mask})["loss"]
    keep = mask != 255
    want = F.cross_entropy(image.permute(0, 2, 3, 1)[keep], mask[keep])
    torch.testing.assert_close(loss, want)
    assert task.after_step() is None and task.last_evaluation == {}
    result = task.evaluate(epoch=1, final=False)
    assert result["eval"] == "val" and result["samples"] == 2 and task.last_evaluation == result


def test_images_without_a_labeled_pixel_give_no_loss_and_a_class_seen_once_counts():
    unlabeled = [{"image": torch.randn(1, 3, 4, 4), "mask": torch.full((1, 4, 4), 255), "bad": []}]
    result = evaluate_segmenter(Channels(), unlabeled, 3)
    assert result["samples"] == 1 and math.isnan(result["loss"]) and math.isnan(result["pixel_acc"])
    once = torch.tensor([[5, 0, 0], [0, 0, 0], [0, 0, 1]])  # class 2: one pixel, found
    assert segmentation_scores(once)["per_class_iou"] == [100.0, None, 100.0]
