import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_images(root, n=32, size=40, seed=0, nested=True, formats=("png", "jpg")):
    """A folder of smooth random colour images (learnable, unlike white noise), nested two deep."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(root)
    paths = []
    for i in range(n):
        coarse = rng.random((4, 4, 3)) * 255
        img = Image.fromarray(coarse.astype("uint8")).resize((size, size), Image.BICUBIC)
        sub = root / (f"a{i % 3}" / Path(f"b{i % 2}") if nested else Path("."))
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"img{i:04d}.{formats[i % len(formats)]}"
        img.save(path)
        paths.append(path)
    return paths


@pytest.fixture
def image_folder(tmp_path):
    make_images(tmp_path / "images")
    return tmp_path / "images"
