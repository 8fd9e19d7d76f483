"""What the feature cache's record tells apart: weights by their values, data by their samples, whatever the reader."""

import torch
from PIL import Image

from mae.data.labeled import split
from mae.data.open import open_source
from mae.train.feature_cache import data_fingerprint, weights_digest
from tests.conftest import make_labeled


def test_weights_are_known_by_their_values():
    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16), "empty": torch.zeros(0)}
    digest = weights_digest(state)
    assert weights_digest(dict(reversed(list(state.items())))) == digest  # not by the order of the keys
    assert weights_digest({k: v.clone() for k, v in state.items()}) == digest
    changed = {**state, "a": state["a"].clone().index_fill_(1, torch.tensor([2]), 7.0)}
    assert weights_digest(changed) != digest
    assert weights_digest({**state, "a": state["a"].view(3, 2)}) != digest  # the same bytes in another shape


def test_data_are_known_by_their_samples(tmp_path):
    import datasets

    folder = make_labeled(tmp_path / "folder", per_class=4, size=16)
    source = open_source(str(folder), labeled=True)
    fingerprint = data_fingerprint(source)
    assert fingerprint == data_fingerprint(open_source(str(folder), labeled=True))  # opened again
    assert fingerprint["samples"] == 12 and fingerprint["classes"] == 3
    train, val = split(source, 0.25, seed=0)
    assert data_fingerprint(train) == data_fingerprint(split(source, 0.25, seed=0)[0])
    assert data_fingerprint(train) != data_fingerprint(split(source, 0.25, seed=1)[0])  # other rows
    assert data_fingerprint(train)["fingerprint"] != data_fingerprint(val)["fingerprint"]
    (folder / "red" / "extra.png").write_bytes(next((folder / "red").iterdir()).read_bytes())
    assert data_fingerprint(open_source(str(folder), labeled=True)) != fingerprint  # a file more
    saved = []
    for shade in (0, 1):
        ds = datasets.Dataset.from_dict(
            {"image": [Image.new("RGB", (8, 8), (i * 40 + shade, 0, 0)) for i in range(4)], "label": [0, 1, 0, 1]}
        )
        ds.save_to_disk(str(tmp_path / f"ds{shade}"))
        saved.append(data_fingerprint(open_source(str(tmp_path / f"ds{shade}"), labeled=True)))
    assert saved[0] == data_fingerprint(open_source(str(tmp_path / "ds0"), labeled=True))
    assert saved[0]["fingerprint"] != saved[1]["fingerprint"]  # the same labels, other images
