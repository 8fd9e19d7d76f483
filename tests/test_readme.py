"""The timm code of the README and of docs/weights.md runs as printed and gives what the stages logged."""

import json
import re
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image

from mae.cli import main
from mae.train.features import knn_scores, topk_accuracy
from tests.conftest import make_images, make_labeled

README = Path(__file__).parents[1] / "README.md"
WEIGHTS = Path(__file__).parents[1] / "docs" / "weights.md"


def snippet(file_name: str, path: Path, page: Path = WEIGHTS) -> dict:
    """Run the page's python block that loads `file_name` in plain timm, on `path`; its variables."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    [code] = [b for b in blocks if f'/{file_name}"' in b and "timm.create_model" in b]
    code = re.sub(rf'"[^"]*/{re.escape(file_name)}"', repr(str(path)), code)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the README's own code
    return namespace


def cli(*args) -> int:
    AcceleratorState._reset_state(True)
    return main([str(a) for a in args])


def last_eval(out: Path) -> dict:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval" in m][-1]


@torch.no_grad()
def features(model, transform, folder: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits or features, pre-logits, labels) of every image below `folder`'s class subfolders."""
    classes = sorted(p.name for p in folder.iterdir())
    files = [(f, i) for i, c in enumerate(classes) for f in sorted((folder / c).iterdir())]
    x = torch.stack([transform(Image.open(f).convert("RGB")) for f, _ in files])
    pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    return model.forward_head(model.forward_features(x)), pooled, torch.tensor([i for _, i in files])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    make_images(root / "imgs", n=32)
    make_labeled(root / "train", per_class=16, seed=0)
    make_labeled(root / "val", per_class=8, seed=1)
    pre = root / "pre"
    fast = ["--loop.mixed_precision", "no", "--data.num_workers", 0]
    assert cli("pretrain", "--data.path", root / "imgs", "--model.name", "mae_vit_micro_patch8", "--model.img_size", 32,
               "--loop.epochs", 2, "--loop.batch_size", 8, "--output_dir", pre, "--loop.progress", "false",
               *fast) == 0  # fmt: skip
    return root, pre, fast


def test_the_encoder_snippet_gives_the_logged_knn_accuracy(data, tmp_path):
    root, pre, fast = data
    assert cli("knn", "--pretrained", pre, "--data.path", root / "train", "--data.val_path", root / "val",
               "--loop.batch_size", 16, "--output_dir", tmp_path / "knn", *fast) == 0  # fmt: skip
    for page in (README, WEIGHTS):
        ns = snippet("encoder.safetensors", pre / "encoder.safetensors", page)
        model, transform = ns["model"].eval(), ns["transform"]
        crop = [t for t in transform.transforms if type(t).__name__ == "CenterCrop"]
        assert list(crop[0].size) == [32, 32]  # the export's input size, not timm's 224 default
        _, bank, bank_labels = features(model, transform, root / "train")
        _, query, labels = features(model, transform, root / "val")
        scores = knn_scores(bank, bank_labels, query, num_classes=3)
        assert topk_accuracy(scores, labels)["top1"] == pytest.approx(last_eval(tmp_path / "knn")["top1"]), page


def test_the_classifier_snippet_gives_the_logged_evaluation_image_by_image(data, tmp_path, evaluations):
    root, pre, fast = data
    out = tmp_path / "ft"
    assert cli("finetune", "--pretrained", pre, "--data.path", root / "train", "--data.val_path", root / "val",
               "--loop.epochs", 3, "--loop.batch_size", 8, "--optim.warmup_epochs", 1, "--output_dir", out,
               "--loop.progress", "false", *fast) == 0  # fmt: skip
    ns = snippet("classifier.safetensors", out / "classifier.safetensors")
    logits, _, labels = features(ns["model"], ns["transform"], root / "val")
    assert ns["classes"] == ["blue", "green", "red"]
    top1 = (logits.argmax(1) == labels).float().mean().item() * 100
    # A trained head, not a fresh one: timm reproduces the logged accuracy, and each image's logits as logged.
    assert top1 == pytest.approx(last_eval(out)["top1"])
    logged, logged_labels = evaluations[-1]  # the labeled folder's order: classes sorted, files sorted in each
    assert torch.equal(labels, logged_labels)
    torch.testing.assert_close(logits, logged, atol=1e-4, rtol=1e-4)
