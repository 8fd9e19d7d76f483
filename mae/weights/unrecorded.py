"""What a file without the model record tells of its model: the shapes of its tensors, and the metadata older
versions of this toolkit (`mae_model_args`, an encoder export's `num_heads` / `img_size` / `mean` / `std`, a run's
config.yaml model and data sections) and transformers' config.json wrote. `mae.weights.importers` asks it only when
a file has no record (`mae.weights.record`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from mae.errors import CheckpointError
from mae.models.registry import preset_config, preset_matching
from mae.models.spec import ModelSpec


def count_blocks(state: dict[str, torch.Tensor], prefix: str) -> int:
    idx = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def infer_model_kwargs(state: dict[str, torch.Tensor], hints: dict[str, Any], path: Path) -> dict[str, Any]:
    """`MaskedAutoencoder` arguments from tensor shapes; `hints` (metadata, overrides) win."""
    proj = state["encoder.patch_embed.proj.weight"]  # [D, C, p, p]
    embed_dim, in_chans, patch = proj.shape[0], proj.shape[1], proj.shape[-1]
    kw: dict[str, Any] = {
        "embed_dim": embed_dim,
        "in_chans": in_chans,
        "patch_size": patch,
        "depth": count_blocks(state, "encoder.blocks."),
        "mlp_ratio": state["encoder.blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
    }
    length = state["encoder.pos_embed"].shape[1] - 1
    side = round(length**0.5)
    if "img_size" not in hints and side * side != length:
        raise CheckpointError(f"{path}: {length} patches are not a square grid; pass img_size=(H, W)")
    kw["img_size"] = side * patch
    preset = preset_matching(embed_dim=embed_dim) or {}
    kw["num_heads"] = preset.get("num_heads")
    kw["encoder_arch"] = preset.get("encoder_arch", "vit_base_patch16_224")
    if "decoder.embed.weight" in state:
        dec = state["decoder.embed.weight"].shape[0]
        kw.update(
            decoder_embed_dim=dec, decoder_depth=count_blocks(state, "decoder.blocks."), decoder_num_heads=dec // 32
        )
        if "decoder.blocks.0.mlp.fc1.weight" in state:
            kw["decoder_mlp_ratio"] = state["decoder.blocks.0.mlp.fc1.weight"].shape[0] / dec
    kw.update({k: v for k, v in hints.items() if v is not None})
    if kw["num_heads"] is None:
        raise CheckpointError(f"{path}: cannot tell the head count of a {embed_dim}-wide ViT; pass num_heads=")
    if isinstance(kw["img_size"], list):
        kw["img_size"] = tuple(kw["img_size"])
    return kw


def hf_hints(config_file: Path) -> dict[str, Any]:
    """What a transformers ViTMAE config.json tells that the tensors do not."""
    c = json.loads(config_file.read_text())
    return {
        "num_heads": c.get("num_attention_heads"),
        "decoder_num_heads": c.get("decoder_num_attention_heads"),
        "img_size": c.get("image_size"),
        "norm_pix_loss": c.get("norm_pix_loss"),
        "mask_ratio": c.get("mask_ratio"),
    }


def legacy_hints(meta: dict[str, str]) -> dict[str, Any]:
    """What files written before the model record say in their metadata (`mae_model_args`, or an encoder export's
    `num_heads`, `img_size`, `mean`, `std`)."""
    hints: dict[str, Any] = json.loads(meta["mae_model_args"]) if "mae_model_args" in meta else {}
    for key in ("num_heads", "img_size", "mean", "std"):
        if key in meta and key not in hints:
            hints[key] = json.loads(meta[key])
    return hints


def legacy_run_hints(config_yaml: Path) -> dict[str, Any]:
    """What the config.yaml of a run from before the model record says: its model and data sections."""
    import yaml

    config = yaml.safe_load(config_yaml.read_text())
    m, data = config["model"], config.get("data") or {}
    hints = {k: v for k, v in preset_config(m["name"]).items() if k == "encoder_arch" or k.endswith("num_heads")}
    hints.update({k: m[k] for k in ("num_heads", "decoder_num_heads") if m.get(k) is not None})
    hints.update(img_size=m["img_size"], mask_ratio=m["mask_ratio"], norm_pix_loss=m["norm_pix_loss"])
    hints.update({k: m[k] for k in ("decoder", "predict_ratio") if k in m})
    hints.update({k: data[k] for k in ("mean", "std") if isinstance(data.get(k), list)})
    return hints


def legacy_encoder_spec(arch: str, args: dict[str, Any], hints: dict[str, Any]) -> ModelSpec:
    """The record of an encoder export written before the record existed, from timm's model args."""
    patch = args.get("patch_size", 16)
    return ModelSpec(
        encoder_arch=arch, img_size=args["img_size"], patch_size=patch if isinstance(patch, int) else patch[0],
        in_chans=args.get("in_chans", 3), embed_dim=args["embed_dim"], depth=args["depth"],
        num_heads=args["num_heads"], mlp_ratio=args.get("mlp_ratio"), mean=hints.get("mean"), std=hints.get("std"),
    )  # fmt: skip
