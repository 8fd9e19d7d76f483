from pathlib import Path

import pytest

from mae.cli import STAGES, parse

RECIPES = sorted((Path(__file__).parents[1] / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_has_a_header(recipe):
    text = recipe.read_text()
    assert text.startswith("#"), "a recipe is headed by its expected result and hardware"
    # recipes/<stage>/<name>.yaml, or recipes/<dataset>/<stage>.yaml
    stage = recipe.parent.name if recipe.parent.name in STAGES else recipe.stem
    cfg = parse(stage, ["--config", str(recipe), "--data.path", "somewhere"])
    assert cfg.data.path == "somewhere"
