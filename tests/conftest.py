import os

import pytest
import torch

# Under `pytest -n N` (pytest-xdist) each worker gets its share of the cores, and so do the processes its tests start
# (torchrun, `mae` subprocesses): N workers at torch's default of one thread per core would oversubscribe the cores.
# Nothing downloads: the Hub, `datasets` and transformers fail at once instead of fetching (set before they are
# imported; the processes the tests start inherit them).
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def evaluations(monkeypatch):
    """Every evaluation pass a stage makes in this process, as (outputs [N, ...], labels [N]) in the evaluated
    source's order: the per-image record an export or a prediction must reproduce (a count of correct images
    hides a drift that moves some images each way)."""
    from mae.train import tasks

    seen, real = [], tasks.predict

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(tasks, "predict", recording)
    return seen


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


@pytest.fixture(scope="module")
def micro_encoder(tmp_path_factory):
    """A random micro ViT's encoder export (seed 0), made once per test module."""
    import mae

    torch.manual_seed(0)
    return mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path_factory.mktemp("enc") / "e.safetensors")


@pytest.fixture
def image_folder(tmp_path):
    make_images(tmp_path / "images")
    return tmp_path / "images"


def held_out(data, fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[int]]:
    """(files, labels) a downstream stage holds out of the labeled folder `data` (--data.val_fraction, --seed) and
    evaluates, in the order of its evaluation record (`evaluations`)."""
    from mae.data.labeled import split
    from mae.data.open import open_source

    _, val = split(open_source(str(data), labeled=True), fraction, seed)
    return [val.name(i) for i in range(len(val))], [int(y) for y in val.labels]


def last_eval(out) -> dict:
    """The last evaluation line of a run folder's metrics.jsonl."""
    import json
    from pathlib import Path

    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "eval" in m][-1]


def make_labeled(root, per_class=24, size=32, seed=0):
    """Class folders whose classes differ by content, not by a constant: random smooth textures whose
    dominant hue (red, green or blue) is the class; shapes, brightness and noise are random in every image."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label, name in enumerate(["red", "green", "blue"]):
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            coarse = rng.uniform(0, 120, (4, 4, 3))
            coarse[..., label] += rng.uniform(60, 135, (4, 4))
            img = np.asarray(Image.fromarray(coarse.astype("uint8")).resize((size, size), Image.BICUBIC), float)
            img = img + rng.normal(0, 12, img.shape)
            Image.fromarray(img.clip(0, 255).astype("uint8")).save(folder / f"{i:03d}.png")
    return Path(root)
