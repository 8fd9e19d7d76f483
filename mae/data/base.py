"""What every map-style source has unless it says otherwise (the protocol itself: `mae.data.open.ImageSource`).

Defaults rather than `hasattr` probes: a caller asks every source the same questions.
"""

from __future__ import annotations

import numpy as np


class BaseSource:
    """Defaults of the source protocol: no stored bytes to copy (`raw` -> None), no shards (`shard_ends` None),
    and decoding at full size (`set_decode_size` ignored). A subclass defines `__len__`, `load`, `load_array`
    and `name`, and overrides what it can do better."""

    shard_ends: np.ndarray | None = None  # cumulative sample counts of a shard set: the sampler's locality windows
    decode_side: int | None = None

    def set_decode_size(self, side: int | None) -> None:
        """Let JPEGs decode at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) while their short side stays
        >= `side`: a 12 MP photo cropped to 224 px needs a fraction of its pixels, and decoding them all
        costs more than the training step. Sources whose images are not JPEG files keep the value unused."""
        self.decode_side = side

    def raw(self, i: int) -> tuple[bytes, str] | None:
        """(the stored bytes, their extension) of image `i`, for `mae shard` to copy without decoding; None
        where the source holds no encoded file (the writer then stores the decoded image as PNG)."""
        return None
