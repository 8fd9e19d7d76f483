"""The one registry behind every extension point: register, look up (aliases too), list, replace, refuse."""

import pytest

import mae
from mae.data.open import list_sources
from mae.models.decoder import list_decoders
from mae.models.masking import list_masks
from mae.registry import Registry


def test_lookup_listing_replacement_and_the_one_line_refusal():
    things = Registry("thing")
    things.register("b", 2)
    things.register("a", 1, aliases=("alpha",))
    assert things.get("a") == 1 and things.get("alpha") == 1 and things.resolve("alpha") == "a"
    assert things.names() == ["b", "a"] and things.aliases() == ["alpha"] and "alpha" in things
    things.register("b", 3)  # a later registration replaces the name and counts as the latest
    assert things.names() == ["a", "b"] and things.values() == [1, 3]
    with pytest.raises(mae.ConfigError, match=r"^unknown thing 'c'; choose one of: a, alpha, b$"):
        things.get("c")
    things.unregister("a")
    assert things.names() == ["b"] and "alpha" not in things


@pytest.mark.parametrize(
    ("look_up", "message"),
    [
        (lambda: mae.stages.get_stage("nope"), "unknown stage 'nope'; choose one of: anomaly, convert,"),
        (lambda: mae.models.masking.mask_generator("nope"), "unknown masking 'nope'; choose one of: block,"),
        (lambda: mae.models.decoder.decoder_class("nope"), "unknown decoder 'nope'; choose one of: cross, mae"),
        (lambda: mae.create_mae("nope"), "unknown preset 'nope'; choose one of: mae_vit_base_patch16,"),
    ],
)
def test_every_registry_refuses_an_unknown_name_alike(look_up, message):
    with pytest.raises(mae.ConfigError) as refused:  # a ConfigError is a ValueError, as model code raised before
        look_up()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_public_listings_read_the_registries():
    assert list_masks() == sorted(list_masks()) and {"random", "block", "inverse_block", "grid"} <= set(list_masks())
    assert {"mae", "cross"} <= set(list_decoders())
    assert list_sources()[-1] == "folder"  # the fallback is asked last: the latest registration is asked first
    assert "mae_vit_base_patch16_dec512d8b" in mae.list_presets(include_aliases=True)
    assert "mae_vit_base_patch16_dec512d8b" not in mae.list_presets()
