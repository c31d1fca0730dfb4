"""How much vlserve and vLLM-CPU slow down on a busy machine: each server (the small random Qwen2-VL, fp32) runs
the same loads of vLLM's own client (benchmarks/vs_vllm_client.py) on a quiet machine and then beside N processes
that spin on the CPU, in one run; prints TTFT and TPOT quiet and busy, each engine's slow-down, and the ratio of
the two slow-downs (goal: vlserve's no worse than vLLM-CPU's).

    .venv/bin/python benchmarks/contention.py --vllm-venv /path/peer/venv [--hogs 2] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_vllm_client import Load, both, checkpoint  # noqa: E402

METRICS = [("median_ttft_ms", "TTFT median ms"), ("median_tpot_ms", "TPOT median ms"),
           ("output_throughput", "output tok/s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="DIR/venv of ../shared/peers/vllm_cpu/setup_venv.sh")
    ap.add_argument("--model", default="small", help="small, medium or a checkpoint folder (default: small)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per CPU)")
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()

    model = checkpoint(args.model, Path(tempfile.mkdtemp(prefix="contention-models-")))
    levels = [int(c) for c in args.concurrency.split(",")]
    loads = [Load(c, max(16, 2 * c), 1, hogs) for c in levels for hogs in (0, args.hogs)]
    print(f"{os.cpu_count()} CPUs; busy = {args.hogs} spinning processes beside the server")
    ours, peer = both(model, args.vllm_venv, loads)
    for i, c in enumerate(levels):
        quiet, busy = 2 * i, 2 * i + 1
        print(f"\nconcurrency {c}")
        print(f"{'metric':<16}{'vlserve quiet':>14}{'busy':>9}{'slow-down':>10}{'vLLM quiet':>12}{'busy':>9}"
              f"{'slow-down':>10}   vlserve's / vLLM's slow-down")
        for key, label in METRICS:
            a, b, x, y = ours[quiet][key], ours[busy][key], peer[quiet][key], peer[busy][key]
            ours_down = b / a if key != "output_throughput" else a / b
            peer_down = y / x if key != "output_throughput" else x / y
            print(f"{label:<16}{a:>14.1f}{b:>9.1f}{ours_down:>9.2f}x{x:>12.1f}{y:>9.1f}{peer_down:>9.2f}x"
                  f"   {ours_down / peer_down:.2f}")


if __name__ == "__main__":
    main()
