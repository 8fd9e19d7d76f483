"""Pretraining-step throughput: this project's step, as `mae pretrain` runs it, beside transformers' ViTMAE.

Both models get the same architecture, batch, precision, optimizer and inputs; their steps are
interleaved one by one in this process so machine noise hits both alike. Warm-up (and compile)
steps are excluded and reported apart.

    python scripts/benchmark.py --preset small            # fp32 and bf16, 2-core CPU friendly
    python scripts/benchmark.py --preset base --precision bf16
    python scripts/benchmark.py --preset base --device cuda --batch 256

The last line reads `ratio_fp32=... ratio_bf16=...` (ours / transformers, images per second).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import mae
from mae.data.transforms import normalize
from mae.train.run import adamw, configure_speed

PRESETS = {
    # name: (our preset, transformers config overrides)
    "small": (
        "mae_vit_small_patch16",
        dict(
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            decoder_hidden_size=256,
            decoder_num_hidden_layers=4,
            decoder_num_attention_heads=8,
            decoder_intermediate_size=1024,
        ),
    ),
    "base": (
        "mae_vit_base_patch16",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            decoder_hidden_size=512,
            decoder_num_hidden_layers=8,
            decoder_num_attention_heads=16,
            decoder_intermediate_size=2048,
        ),
    ),
    "large": (
        "mae_vit_large_patch16",
        dict(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            decoder_hidden_size=512,
            decoder_num_hidden_layers=8,
            decoder_num_attention_heads=16,
            decoder_intermediate_size=2048,
        ),
    ),
}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build_ours(preset: str, device: str, precision: str, compile_model: bool):
    """Our model and optimizer with `mae pretrain`'s default speed settings."""
    model = mae.create_mae(PRESETS[preset][0], img_size=224).to(device)
    opt = adamw(model, lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95))
    configure_speed(model, device, "bf16" if precision == "bf16" else "no")
    forward = torch.compile(model) if compile_model else model

    def step(images, noise, precision):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward(normalize(images, MEAN, STD), noise=noise).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def build_transformers(preset: str, device: str):
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    cfg = ViTMAEConfig(
        image_size=224,
        patch_size=16,
        mask_ratio=0.75,
        norm_pix_loss=True,
        layer_norm_eps=1e-6,
        attn_implementation="sdpa",
        **PRESETS[preset][1],
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
    images = torch.randint(0, 256, (args.batch, 3, 224, 224), dtype=torch.uint8, device=device)
    noise = torch.rand(args.batch, 196, device=device)
    runners = {
        "ours": build_ours(args.preset, device, precision, args.compile)[1],
        "transformers": build_transformers(args.preset, device)[1],
    }
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
    args = parser.parse_args()
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    cores = torch.get_num_threads()
    print(
        f"MAE pretraining step, {args.preset} preset, 224 px, batch {args.batch}, mask 0.75, norm-pix loss, "
        f"AdamW; device {args.device} ({cores} threads), torch {torch.__version__}"
    )
    print()
    print("| precision | implementation | images/s | ms/step | TFLOP/s | GFLOP/image | warm-up s |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for precision in precisions:
        r = measure(args, precision)
        for name in ("ours", "transformers"):
            m = r[name]
            print(
                f"| {precision} | {name} | {m['img_s']:.1f} | {m['ms']:.0f} | {m['tflops']:.3f} | "
                f"{m['flops'] / args.batch / 1e9:.1f} | {m['warmup_s']:.1f} |"
            )
        ratios[precision] = r["ours"]["img_s"] / r["transformers"]["img_s"]
    print()
    print(" ".join(f"ratio_{p}={v:.2f}" for p, v in ratios.items()))


if __name__ == "__main__":
    main()
