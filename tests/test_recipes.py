from pathlib import Path

import pytest

from mae.cli import parse
from mae.stages import list_stages

ROOT = Path(__file__).parents[1] / "recipes"
RECIPES = sorted(p for p in ROOT.rglob("*.yaml") if p.parent.name != "accelerate")
LAUNCH_CONFIGS = sorted((ROOT / "accelerate").glob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_has_a_header(recipe):
    text = recipe.read_text()
    assert text.startswith("#"), "a recipe is headed by its expected result and hardware"
    # recipes/<stage>/<name>.yaml, or recipes/<dataset>/<stage>.yaml
    stage = recipe.parent.name if recipe.parent.name in list_stages() else recipe.stem
    named = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("# stage:")]
    stage = named[0] if named else stage  # a recipe for another stage than its folder's (`# stage: pretrain`)
    cfg = parse(stage, ["--config", str(recipe), "--data.path", "somewhere"])
    assert cfg.data.path == "somewhere"


@pytest.mark.parametrize("config", LAUNCH_CONFIGS, ids=lambda p: p.stem)
def test_launch_configs_load_and_wrap_every_block(config):
    """An `accelerate launch --config_file` for FSDP: Accelerate reads it, and its wrap plan makes every
    transformer block of the MAE (encoder and either decoder) an FSDP unit, which together hold nearly
    all the weights (what sharding saves)."""
    from accelerate.commands.config.config_args import load_config_from_file

    import mae

    assert config.read_text().startswith("#")
    cluster = load_config_from_file(str(config))
    assert cluster.distributed_type == "FSDP" and cluster.fsdp_config["fsdp_version"] == 2
    wrapped = set(cluster.fsdp_config["fsdp_transformer_layer_cls_to_wrap"].split(","))
    for decoder in ("mae", "cross"):
        model = mae.create_mae("mae_vit_large_patch16", depth=2, decoder_depth=2, decoder=decoder)
        blocks = [m for m in model.modules() if type(m).__name__ in wrapped]
        assert len(blocks) == 4
        in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
        assert in_blocks / sum(p.numel() for p in model.parameters()) > 0.9


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_header_is_at_most_12_lines(recipe):
    """Expected result, hardware and time (or "the paper's figure, not run here"); study logs go to docs/results/."""
    header = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) <= 12, f"{recipe.name}: a {len(header)}-line header"
