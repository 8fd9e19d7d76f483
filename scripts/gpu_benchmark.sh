#!/usr/bin/env bash
# One prepared GPU check, a few minutes on one GPU: our pretraining step beside transformers' ViTMAE for
# ViT-B/16 and ViT-L/16 (bf16, batch 256), eager and compiled, then the loader. Writes gpu_benchmark.md
# (or $OUT/gpu_benchmark.md when OUT is set). Goal on one H200: ViT-B/16 >= 4,000 img/s, ViT-L/16 >= 1,400.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/gpu_benchmark.md"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/GPU: /' > "$out"
for preset in base large; do
  python scripts/benchmark.py --device cuda --preset "$preset" --precision bf16 --batch 256 --steps 10 --warmup 3 | tee -a "$out"
  python scripts/benchmark.py --device cuda --preset "$preset" --precision bf16 --batch 256 --steps 10 --warmup 3 --compile \
    | tee -a "$out"
done
python scripts/benchmark_loader.py --images 96 --batch 32 | tee -a "$out"
echo "wrote $out"
