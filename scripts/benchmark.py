"""Pretraining-step throughput: this project's step, as `mae pretrain` runs it, beside transformers' ViTMAE.

Both models get the same architecture, batch, precision, optimizer and inputs; their steps are
interleaved one by one in this process so machine noise hits both alike. Warm-up (and compile)
steps are excluded and reported apart.

    python scripts/benchmark.py --preset small            # fp32 and bf16, 2-core CPU friendly
    python scripts/benchmark.py --preset base --precision bf16
    python scripts/benchmark.py --preset base --device cuda --batch 256
    python scripts/benchmark.py --recipe recipes/fashion_mnist/pretrain.yaml --precision bf16 --batch 128 [--compile]
    python scripts/benchmark.py --preset small --peer cross [--predict_ratio 0.25]   # our two decoders
    python scripts/benchmark.py --recipe recipes/fashion_mnist/pretrain.yaml --peer gray   # 3 channels vs 1

The last line reads `ratio_fp32=... ratio_bf16=...` (ours / the peer, images per second). With
`--peer cross` the peer is this project's step with CrossMAE's decoder (same encoder and masks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

import mae
from mae.data.transforms import normalize
from mae.train.optim import adamw
from mae.train.speed import configure_speed

PRESETS = {"small": "mae_vit_small_patch16", "base": "mae_vit_base_patch16", "large": "mae_vit_large_patch16"}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def our_model(args: argparse.Namespace, **overrides) -> mae.MaskedAutoencoder:
    """The preset at 224 px, or the model section of a pretraining recipe (--recipe)."""
    if args.recipe:
        kwargs = yaml.safe_load(Path(args.recipe).read_text())["model"]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("masking", "grad_checkpointing")}
        return mae.create_mae(kwargs.pop("name", "mae_vit_base_patch16"), **{**kwargs, **overrides})
    return mae.create_mae(PRESETS[args.preset], img_size=224, **overrides)


def build_ours(model: mae.MaskedAutoencoder, device: str, precision: str, compile_model: bool):
    """Our model and optimizer with `mae pretrain`'s default speed settings; the step takes the first
    `model.in_chans` channels of the images it is given."""
    model = model.to(device)
    opt = adamw(model, lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95))
    configure_speed(model, device, "bf16" if precision == "bf16" else "no")
    forward = torch.compile(model) if compile_model else model

    def step(images, noise, precision):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            c = model.in_chans
            loss = forward(normalize(images[:, :c], MEAN[:c], STD[:c]), noise=noise).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def build_transformers(ours: mae.MaskedAutoencoder, device: str):
    """transformers' ViTMAE with the same architecture as `ours`, read off our modules."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    enc, dec = ours.adapter, ours.decoder
    cfg = ViTMAEConfig(
        image_size=ours.img_size[0] if len(set(ours.img_size)) == 1 else tuple(ours.img_size),
        patch_size=ours.patch_size,
        num_channels=ours.in_chans,
        mask_ratio=ours.mask_ratio,
        norm_pix_loss=ours.norm_pix_loss,
        hidden_size=enc.embed_dim,
        num_hidden_layers=enc.depth,
        num_attention_heads=enc.num_heads,
        intermediate_size=ours.encoder.blocks[0].mlp.fc1.out_features,  # ViT-specific, as ViTMAE is a ViT
        decoder_hidden_size=dec.embed.out_features,
        decoder_num_hidden_layers=len(dec.blocks),
        decoder_num_attention_heads=dec.blocks[0].attn.num_heads,
        decoder_intermediate_size=dec.blocks[0].mlp.fc1.out_features,
        layer_norm_eps=1e-6,
        attn_implementation="sdpa",
    )
    model = ViTMAEForPreTraining(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95))

    def step(images, noise, precision):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(pixel_values=normalize(images, MEAN, STD), noise=noise).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def flops_per_step(step, images, noise, precision) -> float:
    with FlopCounterMode(display=False) as counter:
        step(images, noise, precision)
    return counter.get_total_flops()


def measure(args: argparse.Namespace, precision: str) -> dict[str, dict[str, float]]:
    device = args.device
    torch.manual_seed(0)
    ours = our_model(args)
    images = torch.randint(0, 256, (args.batch, ours.in_chans, *ours.img_size), dtype=torch.uint8, device=device)
    noise = torch.rand(args.batch, ours.num_patches, device=device)
    if args.peer == "transformers":
        peer = build_transformers(ours, device)[1]
    else:
        torch.manual_seed(0)
        other = {"cross": dict(decoder="cross", predict_ratio=args.predict_ratio), "gray": dict(in_chans=1)}
        peer = build_ours(our_model(args, **other[args.peer]), device, precision, args.compile)[1]
    runners = {"ours": build_ours(ours, device, precision, args.compile)[1], args.peer: peer}
    result: dict[str, dict[str, float]] = {name: {} for name in runners}
    for name, step in runners.items():  # warm-up (and compilation) apart from the timed steps
        start = time.perf_counter()
        for _ in range(args.warmup):
            step(images, noise, precision)
        sync(device)
        result[name]["warmup_s"] = time.perf_counter() - start
        result[name]["flops"] = flops_per_step(step, images, noise, precision)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.steps):  # interleaved: ours, theirs, ours, theirs ...
        for name, step in runners.items():
            sync(device)
            start = time.perf_counter()
            step(images, noise, precision)
            sync(device)
            times[name].append(time.perf_counter() - start)
    for name in runners:
        t = statistics.median(times[name])
        result[name].update(ms=t * 1000, img_s=args.batch / t, tflops=result[name]["flops"] / t / 1e12)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--precision", choices=["both", "fp32", "bf16"], default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile ours (mae pretrain --loop.compile true)")
    parser.add_argument("--recipe", help="a pretraining recipe whose model section replaces --preset")
    parser.add_argument(
        "--peer",
        choices=["transformers", "cross", "gray"],
        default="transformers",
        help="what ours is compared with: transformers' ViTMAE, our step with the cross decoder, or ours on one "
        "channel (--model.in_chans 1)",
    )
    parser.add_argument("--predict_ratio", type=float, default=1.0, help="with --peer cross")
    args = parser.parse_args()
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    cores = torch.get_num_threads()
    print(
        f"MAE pretraining step, {args.recipe or args.preset + ' preset, 224 px'}, batch {args.batch}, "
        f"{'compiled' if args.compile else 'eager'}, AdamW; device {args.device} ({cores} threads), "
        f"torch {torch.__version__}"
    )
    print()
    print("| precision | implementation | images/s | ms/step | TFLOP/s | GFLOP/image | warm-up s |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for precision in precisions:
        r = measure(args, precision)
        for name in ("ours", args.peer):
            m = r[name]
            print(
                f"| {precision} | {name} | {m['img_s']:.1f} | {m['ms']:.0f} | {m['tflops']:.3f} | "
                f"{m['flops'] / args.batch / 1e9:.1f} | {m['warmup_s']:.1f} |"
            )
        ratios[precision] = r["ours"]["img_s"] / r[args.peer]["img_s"]
    print()
    print(" ".join(f"ratio_{p}={v:.2f}" for p, v in ratios.items()))


if __name__ == "__main__":
    main()
