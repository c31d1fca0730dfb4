"""One mixture-of-experts layer on CUDA: the fused path (two grouped GEMM launches, kernels/triton_moe.py) beside
the expert loop of `Experts` in the same run, at decode and prefill batch sizes, with the bound set by reading
the chosen experts' weights once from HBM.

    python benchmarks/moe_kernel.py [--hidden 2048 --intermediate 768 --experts 128 --top-k 8] [--tokens 1,8,64,512]

The default shapes are one layer of Qwen3-VL-30B-A3B (bf16). Needs CUDA: without it, it says what it would run
and exits 0 (the kernel's logic is tested on the CPU in Triton's interpreter: tests/test_triton_moe.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlserve.model.kernels import FUSED_MOE_ENV  # noqa: E402
from vlserve.model.layers.moe import Experts  # noqa: E402

HBM_GB_S = {"H200": 4800, "H100": 3350, "H800": 3350, "A100": 2039}  # published peak bandwidths


def bandwidth(name: str) -> float | None:
    return next((v for k, v in HBM_GB_S.items() if k in name), None)


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,64,512")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shape = f"H={args.hidden} I={args.intermediate} E={args.experts} k={args.top_k}, bf16"
    if not torch.cuda.is_available():
        print(f"moe_kernel: no CUDA here; on a GPU it times the fused experts vs the expert loop ({shape}) at "
              f"{tokens} tokens")
        return
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = Experts(args.hidden, args.intermediate, args.experts, "silu")
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.02)
        layer.down_proj.normal_(0, 0.02)
    layer = layer.to(device, torch.bfloat16)
    name = torch.cuda.get_device_name()
    bw = bandwidth(name)
    expert_bytes = 3 * args.hidden * args.intermediate * 2  # gate, up, down in bf16
    print(f"moe_kernel on {name}: {shape}")
    print("| tokens | loop ms | fused ms | fused/loop speed-up | experts read | bound ms |")
    print("|---|---|---|---|---|---|")
    for t in tokens:
        x = torch.randn(t, args.hidden, device=device, dtype=torch.bfloat16)
        probs = torch.randn(t, args.experts, device=device).softmax(-1)
        weights, experts = torch.topk(probs, args.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
        touched = experts.unique().numel()
        timings = {}
        with torch.no_grad():
            for setting in ("0", "1"):
                os.environ[FUSED_MOE_ENV] = setting
                timings[setting] = time_ms(lambda: layer(x, experts, weights))
        bound = f"{touched * expert_bytes / (bw * 1e9) * 1e3:.3f}" if bw else "?"
        print(f"| {t} | {timings['0']:.3f} | {timings['1']:.3f} | {timings['0'] / timings['1']:.2f}x | {touched} | "
              f"{bound} |")


if __name__ == "__main__":
    main()
