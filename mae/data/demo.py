"""The demo photos that ship inside scikit-image: what `mae pretrain` reads when no path is given."""

from __future__ import annotations

import numpy as np
from PIL import Image

from mae.data.base import BaseSource
from mae.data.images import image_array, to_rgb
from mae.errors import DataError

# scikit-image's bundled photos (CC0 / public domain), loaded without any download.
DEMO_IMAGES = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "camera",
    "coins",
    "moon",
    "clock",
    "grass",
    "gravel",
    "brick",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "cat",
)
DEMO_REPEATS = 16  # each photo appears this often per epoch, each time with its own crop


class DemoSource(BaseSource):
    """scikit-image's bundled photos, each repeated `DEMO_REPEATS` times per epoch."""

    def __init__(self) -> None:
        import skimage.data

        self.images: list[tuple[str, Image.Image]] = []
        for name in DEMO_IMAGES:
            try:
                a = np.asarray(getattr(skimage.data, name)())
            except Exception:  # noqa: BLE001 - an image the installed version lacks is simply left out
                continue
            self.images.append((name, to_rgb(Image.fromarray(a))))
        if not self.images:
            raise DataError("the demo images of scikit-image could not be loaded; pass --data.path")

    def __len__(self) -> int:
        return len(self.images) * DEMO_REPEATS

    def name(self, i: int) -> str:
        return f"skimage.data.{self.images[i % len(self.images)][0]}"

    def load(self, i: int) -> Image.Image:
        return self.images[i % len(self.images)][1].copy()

    def load_array(self, i: int) -> np.ndarray:
        return image_array(np.asarray(self.images[i % len(self.images)][1]), self.name(i))
