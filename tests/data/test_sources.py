import io

import numpy as np
import pytest
from PIL import Image, features

from mae.data.demo import DemoSource
from mae.data.folder import FolderSource
from mae.data.hf import HFSource
from mae.data.images import read_array, read_rgb, to_rgb
from mae.data.open import open_source
from mae.errors import DataError


def _exif_rotated_jpeg(path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    img.save(path, exif=exif.tobytes())


def test_to_rgb_converts_every_mode(tmp_path):
    sixteen = Image.fromarray(np.array([[0, 32768], [65535, 65535]], dtype=np.uint16))
    out = np.asarray(to_rgb(sixteen))
    assert out.shape == (2, 2, 3) and out[0, 0, 0] == 0 and out[0, 1, 0] == 128 and out[1, 0, 0] == 255
    palette = Image.new("P", (4, 4))
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # red
    gray = Image.new("L", (4, 4), 77)
    for img in (palette, rgba, cmyk, gray):
        assert to_rgb(img).mode == "RGB"
    assert to_rgb(cmyk).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(gray).getpixel((0, 0)) == (77, 77, 77)
    _exif_rotated_jpeg(tmp_path / "r.jpg")
    with Image.open(tmp_path / "r.jpg") as img:
        assert to_rgb(img).size == (20, 40)


@pytest.mark.parametrize(
    "mode,compression",
    [
        ("RGB", "tiff_lzw"),
        ("RGB", "jpeg"),
        ("RGB", "packbits"),
        ("CMYK", None),
        ("P", None),
        ("YCbCr", None),
        ("LA", None),
        ("RGBA", None),
        ("1", "group4"),
        ("L", None),
    ],
)
def test_a_tiff_picture_reads_as_pil_shows_it(tmp_path, mode, compression):
    """TIFF photos and scans (compressed as cameras and scanners write them, in any colour encoding) read in
    an RGB run as PIL decodes them, from a folder and from a shard's bytes; in any-channel runs too."""
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).convert(mode)
    path = tmp_path / "a.tif"
    img.save(path, **({"compression": compression} if compression else {}))
    with Image.open(path) as shown:
        expected = np.asarray(to_rgb(shown))
        bands = np.asarray(shown.convert("L" if mode in ("1", "L", "LA") else "RGB"))
    assert np.array_equal(np.asarray(FolderSource(tmp_path).load(0)), expected)
    assert np.array_equal(np.asarray(read_rgb(str(path), io.BytesIO(path.read_bytes()))), expected)
    array = read_array(str(path), io.BytesIO(path.read_bytes()))
    assert np.array_equal(np.round(array * 255).astype(np.uint8), bands.reshape(array.shape))


def test_folder_is_recursive_mixed_and_sorted(tmp_path):
    root = tmp_path / "data"
    (root / "x" / "y" / "z").mkdir(parents=True)
    exts = ["jpg", "png", "webp", "bmp", "tiff", "JPEG", "jfif", "pnm"] + (["avif"] if features.check("avif") else [])
    for i, ext in enumerate(exts):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(root / ("x/y/z" if i % 2 else "x") / f"{i}.{ext}")
    (root / "notes.txt").write_text("not an image")
    (root / ".hidden.jpg").write_bytes(b"")
    src = open_source(str(root))
    assert isinstance(src, FolderSource) and len(src) == len(exts)
    assert list(src.paths) == sorted(src.paths)
    assert all(src.load(i).mode == "RGB" for i in range(len(src)))


def test_listing_does_not_decode(tmp_path):
    # 5,000 empty "images": listing only looks at names, so it succeeds; decoding happens later.
    for i in range(5000):
        (tmp_path / f"{i}.jpg").touch()
    assert len(FolderSource(tmp_path)) == 5000


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        open_source(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no images found"):
        open_source(str(tmp_path))
    (tmp_path / "f.png").write_bytes(b"x")
    with pytest.raises(DataError, match="expected a folder"):
        open_source(str(tmp_path / "f.png"))


def _image_dataset(n=6):
    import datasets

    imgs = [Image.new("RGB", (12, 10), (i * 30, 0, 0)) for i in range(n)]
    return datasets.Dataset.from_dict(
        {"label": list(range(n)), "img": imgs},
        features=datasets.Features({"label": datasets.Value("int64"), "img": datasets.Image()}),
    )


def test_save_to_disk_folder(tmp_path):
    _image_dataset().save_to_disk(str(tmp_path / "ds"))
    src = open_source(str(tmp_path / "ds"))
    assert isinstance(src, HFSource) and src.column == "img" and len(src) == 6
    assert src.load(3).getpixel((0, 0)) == (90, 0, 0)
    with pytest.raises(DataError, match="--data.image_column nope"):
        open_source(str(tmp_path / "ds"), image_column="nope")


def test_hf_prefix_goes_through_load_dataset(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (8, 8)).save(folder / f"{i}.png")
    src = open_source(f"hf:{folder}")  # load_dataset("<local folder>") uses the imagefolder builder
    assert isinstance(src, HFSource) and len(src) == 4 and src.load(0).size == (8, 8)


def test_demo_photos_ship_with_scikit_image():
    src = DemoSource()
    assert len(src.images) >= 5
    img = src.load(0)
    assert img.mode == "RGB" and min(img.size) >= 256
    assert np.asarray(img).std() > 20  # a photo, not a flat image


def test_hf_source_reads_undecoded_bytes():
    buf = io.BytesIO()
    Image.new("RGB", (5, 5), (1, 2, 3)).save(buf, format="PNG")
    import datasets

    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": buf.getvalue(), "path": None}]},
        features=datasets.Features({"image": datasets.Image(decode=False)}),
    )
    assert HFSource(ds, None, "t").load(0).getpixel((0, 0)) == (1, 2, 3)


def test_hf_source_reads_a_column_of_file_paths(tmp_path):
    """--data.image_column naming a text column: its values are image files, as datasets' Image feature reads
    paths; with no column named, a table without an image column stays an error."""
    import datasets

    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.new("L" if i == 1 else "RGB", (6, 4), (40 * i,) * (1 if i == 1 else 3)).save(paths[-1])
    ds = datasets.Dataset.from_dict({"file": paths, "label": [0, 1, 0]})
    src = HFSource(ds, "file", "t")
    assert [np.asarray(src.load(i)).tolist() for i in range(3)] == [
        np.asarray(to_rgb(Image.open(path))).tolist() for path in paths
    ]
    assert src.load_array(1).shape == (4, 6, 1) and src.raw(0)[1] == "png"
    with pytest.raises(DataError, match="no image column"):
        HFSource(ds, None, "t")


def test_large_jpegs_decode_at_a_reduced_scale(tmp_path):
    Image.new("RGB", (2000, 1600), (10, 200, 30)).save(tmp_path / "big.jpg")
    Image.new("RGB", (2000, 1600), (10, 200, 30)).save(tmp_path / "big.png")
    src = FolderSource(tmp_path)
    src.set_decode_size(300)
    jpeg, png = src.load(0), src.load(1)
    assert jpeg.size == (500, 400)  # 1/4 scale: the smallest reduction keeping the short side >= 300
    assert png.size == (2000, 1600)  # only JPEG decoders can scale
    src.set_decode_size(None)
    assert src.load(0).size == (2000, 1600)
