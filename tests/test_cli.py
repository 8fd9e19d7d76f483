"""The command line: every option documented, every range checked, in every stage."""

import typing
from dataclasses import fields, is_dataclass

import pytest

from mae.cli import build_parser, main
from mae.stages import get_stage, list_stages

# What each stage needs before any option is looked at (so that the range check is what answers).
REQUIRED = {
    "visualize": ["--images", "a.png"],
    "export": ["--checkpoint", "c", "--output", "o"],
    "convert": ["src", "--output", "o"],
    "shard": ["src", "--output", "o"],
}


def ruled_fields(cls, prefix=""):
    """(dotted name, field) of every field of a config that carries a constraint."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            yield from ruled_fields(hints[f.name], f"{prefix}{f.name}.")
        elif "rule" in f.metadata:
            yield f"{prefix}{f.name}", f


def bad_value(f) -> list[str] | None:
    """Command-line words for a value of `f`'s type that its rule refuses."""
    rule = f.metadata["rule"]
    inner = str(f.type).split("tuple[")[1].split("]")[0].split(",") if "tuple[" in str(f.type) else []
    length = len(f.default) if isinstance(f.default, tuple) else (3 if "..." in inner[-1:] else len(inner))
    for value in (-1, 0, 1, 1.5, 10**9):
        as_tuple = length > 0
        candidate = (value,) * length if as_tuple else value
        if "float" not in str(f.type) and isinstance(value, float):
            continue
        if not rule.ok(candidate):
            return [f"[{', '.join(map(str, candidate))}]" if as_tuple else str(value)]
    if isinstance(f.default, tuple):  # an ordered pair: min above max
        return ["[0.9, 0.5]"] if not rule.ok((0.9, 0.5)) else None
    return None


@pytest.mark.parametrize("stage", list_stages())
def test_help_describes_every_option(stage):
    parser = build_parser(stage)
    undocumented = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.option_strings[0] != "-h" and not (a.help or "").strip()
    ]
    assert not undocumented
    # The group headers read as the stage's sections, not as dataclass signatures.
    assert "Config(" not in parser.format_help()


@pytest.mark.parametrize("stage", list_stages())
def test_out_of_range_numbers_exit_2_with_one_line(stage, capsys):
    cls = get_stage(stage).config
    checked = 0
    for name, f in ruled_fields(cls):
        value = bad_value(f)
        assert value is not None, f"no out-of-range value found for {name}"
        code = main([stage, *REQUIRED.get(stage, []), f"--{name}", *value])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, value)
        assert len(err) == 1 and err[0].startswith(f"mae {stage}: error: --{name} "), (name, err)
        checked += 1
    assert checked >= {"pretrain": 30, "linprobe": 20, "finetune": 25, "knn": 9, "export": 0}.get(stage, 1)


def test_every_training_stage_checks_log_and_eval_intervals(capsys):
    for stage in ("pretrain", "linprobe", "finetune"):
        for option, value in (("--loop.log_every", "0"), ("--loop.eval_every", "-1")):
            assert main([stage, option, value]) == 2
            assert f"{option} {value}: must be >= " in capsys.readouterr().err


def test_a_missing_required_option_is_named_with_its_dashes(capsys):
    assert main(["export", "--checkpoint", "x"]) == 2
    assert "--output" in capsys.readouterr().err


def test_a_missing_option_is_named_as_users_type_it(capsys):
    assert main(["shard"]) == 2
    assert capsys.readouterr().err.strip() == "mae shard: error: the following arguments are required: --output, source"
