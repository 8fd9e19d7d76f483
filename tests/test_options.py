"""Each stage's options are the ones it reads: every stage runs at tiny sizes with the reads of its config recorded,
and an option its `--help` lists that no run read is a defect (the stage's config must not have it)."""

from __future__ import annotations

import dataclasses
import sys
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState

import mae
import mae.config
import mae.weights.hub
from mae.cli import build_parser, main
from mae.stages import get_stage, list_stages
from tests.conftest import make_images, make_labeled
from tests.segment.helpers import make_segmentation

# Code that reads every field alike (copies, comparisons, YAML, range checks, the parser) is not a stage reading
# an option: reads from these files do not count.
GENERIC = (
    dataclasses.__file__,
    getattr(mae.config, "__path__", [mae.config.__file__])[0],
    str(Path(sys.modules["jsonargparse"].__file__).parent),
    "<",  # the methods dataclasses generate (__eq__, __repr__, ...)
)

TINY_MODEL = {"name": "mae_vit_micro_patch8", "img_size": 32}
# Two epochs: the interval options (eval_every, ...) are read only between epochs, never after the last.
TRAIN_LOOP = {"epochs": 2, "batch_size": 8, "progress": False, "mixed_precision": "no", "log_every": 1}


def config_classes(cls: type) -> list[type]:
    """The config dataclass and its sections, recursively."""
    hints = typing.get_type_hints(cls)
    found = [cls]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found += config_classes(hints[f.name])
    return found


def owner(cls: type, dotted: str) -> tuple[type, str]:
    """(the section class, the field) that an option such as `loop.epochs` names."""
    *sections, name = dotted.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return cls, name


@contextmanager
def recording(cls: type, seen: set[tuple[type, str]]):
    """Record (class, field) for every field of `cls` and its sections read by a stage's own code."""
    classes = config_classes(cls)

    def make(klass: type):
        names = {f.name for f in dataclasses.fields(klass)}

        def getattribute(obj, name):
            if name in names:
                caller = sys._getframe(1).f_code.co_filename
                if not caller.startswith(GENERIC):
                    seen.add((klass, name))
            return object.__getattribute__(obj, name)

        return getattribute

    for klass in classes:
        klass.__getattribute__ = make(klass)
    try:
        yield
    finally:
        for klass in classes:
            del klass.__getattribute__


def options(stage: str) -> list[str]:
    """Every option `mae <stage> --help` lists, as dotted field names (sections' own `--model CONFIG` aside)."""
    cls = get_stage(stage).config
    found = []
    for action in build_parser(stage)._actions:
        dest = action.dest
        if dest in ("help", "config", "print_config") or dest.startswith("__"):
            continue
        section, name = owner(cls, dest)
        if not dataclasses.is_dataclass(typing.get_type_hints(section).get(name)):
            found.append(dest)
    return found


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    make_images(root / "images", n=16)
    make_labeled(root / "labeled", per_class=8)
    start = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), root / "start.safetensors")
    return root, start


def runs(root: Path, start: Path) -> dict[str, list[dict]]:
    """Each stage's runs (overrides of `mae.<stage>(...)`), in an order where each finds what it needs: together they
    take every path on which a stage reads an option."""
    images, labeled, pre = str(root / "images"), str(root / "labeled"), root / "pre"
    scenes = str(make_segmentation(root / "scenes", n=12))
    downstream = {"data": {"path": labeled, "num_workers": 0}, "loop": TRAIN_LOOP, "optim": {"warmup_epochs": 1}}
    return {
        "pretrain": [
            dict(
                data={"path": images, "num_workers": 0, "preview_bands": [0, 1, 2]},
                model=TINY_MODEL,
                loop=TRAIN_LOOP,
                optim={"warmup_epochs": 1, "clip_grad": 1.0},
                monitor={"knn_data": labeled},
                export_decoder=True,
                output_dir=pre,
            ),
            dict(
                init=start,
                data={"path": images, "num_workers": 0},
                model={"img_size": 32},
                loop=TRAIN_LOOP,
                optim={"warmup_epochs": 1},
                output_dir=root / "init",
            ),
        ],
        "knn": [
            dict(
                pretrained=pre,
                data={"path": labeled, "num_workers": 0},
                loop={"batch_size": 8},
                output_dir=root / "knn",
            )
        ],
        "linprobe": [dict(pretrained=pre, cache_dir=root / "cache", output_dir=root / "lp", **downstream)],
        "finetune": [dict(pretrained=pre, model={"ema_decay": 0.9}, output_dir=root / "ft", **downstream)],
        "segment": [
            dict(
                pretrained=pre,
                head="progressive",
                model={"frozen_blocks": 1, "drop_path": 0.1},
                data={"path": scenes, "num_workers": 0, "num_classes": 2},
                aug={"scale": [0.8, 1.2], "hflip": 0.5},
                output_dir=root / "seg",
                **{k: v for k, v in downstream.items() if k != "data"},
            ),
        ],
        "predict": [
            dict(pretrained=root / "lp", data={"path": images, "num_workers": 0}, output=root / "p.csv"),
            dict(pretrained=root / "seg", data={"path": scenes, "num_workers": 0}, output_dir=root / "masks"),
        ],
        "anomaly": [
            dict(
                pretrained=pre,
                data={"path": labeled, "num_workers": 0},
                normal="red",
                score="all",
                train_path=images,
                loop={"batch_size": 8},
                output_dir=root / "anomaly",
            )
        ],
        "visualize": [
            dict(images=[images], checkpoint=pre, output=root / "v.png"),
            dict(images=[images], pretrained=pre, attention=True, output=root / "a.png"),
        ],
        "export": [
            dict(checkpoint=pre, output=root / "e.safetensors", with_decoder=True),
            dict(checkpoint=pre, output=root / "e.onnx", format="onnx"),
            dict(checkpoint=pre, output=root / "hub", push_to_hub="me/tiny", private=True),
        ],
        "convert": [dict(source=pre, output=root / "c.safetensors")],
        "stats": [dict(data={"path": images}, samples=8)],
        "shard": [dict(source=labeled, output=root / "shards", max_size=16)],
    }


@pytest.fixture(scope="module")
def reads(data, tmp_path_factory):
    """For each stage, the options its runs read, and its options that they did not."""
    root, start = data
    plan = runs(root, start)
    unplanned = [s for s in list_stages() if s not in plan and get_stage(s).run.__module__.startswith("mae.")]
    assert not unplanned, f"add runs of {unplanned} that take every path on which they read an option"
    found = {}
    with pytest.MonkeyPatch.context() as mp:  # the Hub, faked: the export's push path runs without a network
        mp.setattr(mae.weights.hub, "hub_token", lambda: "token")
        mp.setattr(mae.weights.hub, "push_to_hub", lambda path, repo, private, revision: f"hub/{repo}")
        for stage, overrides in plan.items():
            seen: set[tuple[type, str]] = set()
            for kwargs in overrides:
                with recording(get_stage(stage).config, seen):
                    mae.api.run(stage, **kwargs)
                AcceleratorState._reset_state(True)
            cls = get_stage(stage).config
            found[stage] = [o for o in options(stage) if owner(cls, o) not in seen]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("stage", list_stages())
def test_every_option_in_a_stages_help_is_one_it_reads(stage, reads):
    if stage not in reads:
        pytest.skip(f"{stage}: a stage from outside the package")
    assert reads[stage] == [], f"mae {stage} --help lists options it never reads: {reads[stage]}"


def test_an_option_a_stage_does_not_read_is_refused_with_one_line(tmp_path, capsys):
    """On the command line and in a recipe alike, as a typo is."""
    assert main(["knn", "--loop.epochs", "3"]) == 2
    assert capsys.readouterr().err.strip() == "mae knn: error: unrecognized arguments: --loop.epochs 3"
    recipe = tmp_path / "probe.yaml"
    recipe.write_text("model:\n  pool: avg\n  drop_path: 0.1\n")  # a fine-tuning option, in a probe's recipe
    assert main(["linprobe", "--config", str(recipe)]) == 2
    assert capsys.readouterr().err.strip() == "mae linprobe: error: Group 'model' does not accept option 'drop_path'"
    with pytest.raises(mae.ConfigError, match=r"^Group 'loop' does not accept option 'log_with'$"):  # the API: the same
        mae.anomaly(loop={"log_with": "none"})
