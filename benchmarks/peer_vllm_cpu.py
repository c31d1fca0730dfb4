"""The vLLM-CPU side of vs_vllm_cpu.py. Runs inside vLLM's own venv (../shared/peers/README.md); prints one JSON
line with the phase results.

    VENV/bin/python benchmarks/peer_vllm_cpu.py --model DIR --dtype float32 --num-requests 24
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from picture_workload import make_workload, run_phases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--phases", default="offline,decode,ttft,prefill")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, limit_mm_per_prompt={"image": 1})
    result = run_phases(llm, SamplingParams, make_workload(args.num_requests), phases=tuple(args.phases.split(",")))
    print("PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
