"""The one factory, `mae.data.open.open_source`: every kind behind one call, and a kind registered from outside."""

import io
import zipfile

import numpy as np
import pytest
from PIL import Image

from mae.data.base import BaseSource
from mae.data.demo import DemoSource
from mae.data.folder import FolderSource, LabeledFolder
from mae.data.hf import HFSource, LabeledHF
from mae.data.images import IMAGE_EXTENSIONS, read_array, read_rgb
from mae.data.open import (
    ImageSource,
    LabeledSource,
    SourceKind,
    list_sources,
    open_source,
    register_source,
    unregister_source,
)
from mae.data.shard_writer import write_shards
from mae.data.shards import LabeledShards, ShardSource
from mae.data.transforms import PretrainSamples
from mae.errors import DataError
from tests.conftest import make_labeled


class ZipSource(BaseSource):
    """The images inside a .zip file, in name order; labeled, by their top folder inside the zip."""

    def __init__(self, path: str, labeled: bool, option: str) -> None:
        self.path = path
        with zipfile.ZipFile(path) as zf:
            self.members = sorted(n for n in zf.namelist() if n[n.rfind(".") :].lower() in IMAGE_EXTENSIONS)
        if labeled:
            tops = [n.split("/", 1)[0] if "/" in n else None for n in self.members]
            if None in tops:
                raise DataError(f"{option} {path}: images outside any class folder")
            self.classes = sorted(set(tops))
            self.labels = np.asarray([self.classes.index(t) for t in tops], dtype=np.int64)

    def _file(self, i: int) -> io.BytesIO:
        with zipfile.ZipFile(self.path) as zf:
            return io.BytesIO(zf.read(self.members[i]))

    def __len__(self) -> int:
        return len(self.members)

    def name(self, i: int) -> str:
        return f"{self.path}:{self.members[i]}"

    def load(self, i: int) -> Image.Image:
        return read_rgb(self.members[i], self._file(i), self.decode_side)

    def load_array(self, i: int) -> np.ndarray:
        return read_array(self.members[i], self._file(i))


class ZipKind(SourceKind):
    name = "zip"

    def matches(self, path) -> bool:
        return isinstance(path, str) and path.endswith(".zip")

    def open(self, path, *, labeled, image_column, label_column, option):
        return ZipSource(path, labeled, option)


@pytest.fixture
def zip_kind():
    register_source(ZipKind)
    yield
    unregister_source("zip")


@pytest.fixture
def zipped(tmp_path):
    folder = make_labeled(tmp_path / "folder", per_class=2, size=16)
    path = tmp_path / "x.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(folder.rglob("*.*")):
            zf.write(f, f.relative_to(folder).as_posix())
    return path, folder


def test_a_kind_registered_from_outside_reads_through_the_factory(zip_kind, zipped, tmp_path):
    path, folder = zipped
    assert list_sources()[0] == "zip"  # the latest registration is asked first
    plain = open_source(str(path))
    assert isinstance(plain, ZipSource) and isinstance(plain, ImageSource) and len(plain) == 6
    assert not hasattr(plain, "labels")
    labeled = open_source(path, labeled=True)  # a PathLike too
    assert isinstance(labeled, LabeledSource) and labeled.classes == ["blue", "green", "red"]
    by_folder = open_source(str(folder), labeled=True)
    assert isinstance(by_folder, LabeledFolder) and labeled.classes == by_folder.classes
    assert labeled.labels.tolist() == by_folder.labels.tolist()  # the same files in the same order
    for i in range(6):
        assert np.array_equal(np.asarray(labeled.load(i)), np.asarray(by_folder.load(i)))
    assert open_source(str(path), labeled=None).classes == labeled.classes  # labeled where it can be
    # the rest of the house takes it as any other source: samples, shards written and read back
    assert PretrainSamples(plain, img_size=(16, 16), patch_size=4, seed=0)[(0, 0)]["image"].shape == (3, 16, 16)
    write_shards(labeled, tmp_path / "shards", progress=False)
    back = open_source(str(tmp_path / "shards"), labeled=True)
    assert isinstance(back, LabeledShards) and sorted(back.labels.tolist()) == sorted(labeled.labels.tolist())
    with pytest.raises(DataError, match="--data.streaming true: streams hf:NAME"):
        open_source(str(path), streaming=True)


def test_unregistered_the_kind_is_gone(zipped):
    path, _ = zipped
    assert "zip" not in list_sources()
    with pytest.raises(DataError, match="expected a folder"):  # the fallback, a folder, refuses it
        open_source(str(path))


def test_built_in_kinds_in_the_order_they_are_asked():
    assert list_sources() == ["<datasets.Dataset>", "demo", "shards", "hf", "folder"]


def test_every_built_in_kind_labeled_or_not(tmp_path):
    import datasets

    folder = make_labeled(tmp_path / "folder", per_class=2, size=16)
    assert type(open_source(str(folder))) is FolderSource
    assert type(open_source(str(folder), labeled=True)) is LabeledFolder
    write_shards(open_source(str(folder), labeled=True), tmp_path / "shards", progress=False)
    assert type(open_source(str(tmp_path / "shards"))) is ShardSource
    assert type(open_source(str(tmp_path / "shards"), labeled=None)) is LabeledShards
    images = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(4)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 0, 1]})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert type(open_source(str(tmp_path / "saved"))) is HFSource
    assert type(open_source(str(tmp_path / "saved"), labeled=True)) is LabeledHF
    as_object = open_source(ds, labeled=True)  # the Python API: a Dataset itself
    assert type(as_object) is LabeledHF and as_object.labels.tolist() == [0, 1, 0, 1]
    assert as_object.name(2) == "<datasets.Dataset>[2]" and as_object.load(2).getpixel((0, 0)) == (80, 0, 0)
    with pytest.raises(DataError, match="no label column"):
        open_source(ds.remove_columns("label"), labeled=True)
    assert type(open_source(ds.remove_columns("label"), labeled=None)) is HFSource
    assert isinstance(open_source(None), DemoSource)


def test_what_cannot_be_given_is_one_line_naming_the_option(tmp_path):
    from tests.conftest import make_images

    make_images(tmp_path / "imgs", n=12)  # a0/b0, a0/b1, a1/b0, ...: no class folders
    with pytest.raises(DataError, match=r"^--monitor.knn_data: not given, and the demo photos have no labels"):
        open_source(None, labeled=True, option="--monitor.knn_data")
    with pytest.raises(DataError, match=r"^source .*imgs: this looks like an unlabeled nested folder"):
        open_source(str(tmp_path / "imgs"), labeled=True, option="source")
    with pytest.raises(DataError, match=r"^--data.val_path .*missing: no such folder"):
        open_source(str(tmp_path / "missing"), labeled=True, option="--data.val_path")
    with pytest.raises(DataError, match=r"^--data.streaming true: streams hf:NAME\[:split\] only"):
        open_source(str(tmp_path / "imgs"), streaming=True)
    with pytest.raises(DataError, match=r"^--data.path 3: no source kind reads this \(kinds: "):
        open_source(3)
