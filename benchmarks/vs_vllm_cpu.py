"""vlserve against vLLM-CPU on the same offline picture workload, in one run, beside this machine's limits.

Both engines run `picture_workload.run_phases` (same pictures, prompts, output lengths, dtype by vlserve's `auto`
rule), each in its own fresh process, one after the other: the whole workload offline, batch-1 decode, the time
to first token of one unseen 448x448 picture, and the prompt throughput of 24 new ~410-token text prompts.
vlserve can also run with `--quantization` values (extra rows, same run). First this machine's limits are
measured: GEMM GFLOP/s (fp32, bf16) and memory read GB/s.

    .venv/bin/python benchmarks/vs_vllm_cpu.py --vllm-venv /path/peer/venv [--model DIR] [--quantization int8]

vLLM-CPU set-up: ../shared/peers/README.md (setup_venv.sh DIR). Without --vllm-venv only vlserve runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_bounds import (  # noqa: E402
    QUANTIZED_WEIGHT_BYTES,
    active_lm_params,
    decode_bytes_per_token,
    gemm_flops,
    head_bytes,
    read_bandwidth,
    vision_flops_per_patch,
)
from online_serving import vllm_env  # noqa: E402
from picture_workload import make_workload, run_phases  # noqa: E402


def run_ours(args) -> dict:
    from vlserve import LLM, SamplingParams

    quant = None if args.quantization_one == "none" else args.quantization_one
    extra = {} if quant is None else {"quantization": quant}
    llm = LLM(args.model, dtype=args.dtype, **extra, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=2.0, max_model_len=4096)
    return run_phases(llm, SamplingParams, make_workload(args.num_requests), phases=tuple(args.phases.split(",")))


def in_subprocess(cmd: list[str], env: dict | None, name: str) -> dict | None:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"[{name}] running (log: {log.name})", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line.removeprefix("PEER_RESULT "))
    print(f"[{name}] failed (exit {proc.returncode}); see {log.name}", flush=True)
    return None


def best_of(a: dict | None, b: dict | None) -> dict | None:
    """Each figure's best of two runs (most tok/s, least seconds)."""
    if not a or not b:
        return a or b
    best = dict(a)
    for key, value in b.items():
        if key in ("offline_seconds", "ttft_448_s"):
            best[key] = min(value, a.get(key, value))
            if key == "offline_seconds" and value < a.get(key, value):
                best["offline_output_tokens"] = b["offline_output_tokens"]
                best["offline_prompt_tokens"] = b["offline_prompt_tokens"]
        elif key in ("decode_tok_s", "prefill_tok_s"):
            best[key] = max(value, a.get(key, value))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--vllm-venv", type=Path, help="the venv setup_venv.sh made (DIR/venv)")
    ap.add_argument("--quantization", default="", help="comma-separated extra vlserve rows: int8, awq, gptq (the "
                    "4-bit ones on a copy of the checkpoint exported by vlserve.tools.int4_export)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--phases", default="offline,decode,ttft,prefill")
    ap.add_argument("--rounds", type=int, default=1, help="run every engine this many times, alternating, and keep "
                    "each figure's best (the machines' speed drifts by tens of percent over minutes)")
    ap.add_argument("--quantization-one", help=argparse.SUPPRESS)  # internal: run one vlserve row, print JSON
    args = ap.parse_args()

    if args.quantization_one:
        print("PEER_RESULT " + json.dumps(run_ours(args)), flush=True)
        return
    from vlserve.model.hardware import detect, resolve_dtype
    from vlserve.model.hf_config import load_model_config

    if args.model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    cfg = load_model_config(args.model)
    dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype, torch.device("cpu"), announce=False)
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"machine: {detect().describe()}, {torch.get_num_threads()} threads; dtype {args.dtype} -> {dtype_name}")
    flops = {dt: gemm_flops(dt) for dt in (torch.float32, torch.bfloat16)}
    bandwidth = read_bandwidth()
    print(f"limits : GEMM fp32 {flops[torch.float32] / 1e9:.0f} GFLOP/s, bf16 {flops[torch.bfloat16] / 1e9:.0f} "
          f"GFLOP/s; memory read {bandwidth / 1e9:.1f} GB/s")

    common = ["--model", args.model, "--dtype", dtype_name, "--num-requests", str(args.num_requests),
              "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--phases", args.phases]
    commands: dict[str, tuple[list[str], dict | None]] = {}
    for quant in ["none"] + [q for q in args.quantization.split(",") if q]:
        name = "vlserve" if quant == "none" else f"vlserve {quant}"
        cmd = [sys.executable, __file__, *common, "--quantization-one", quant]
        if quant in ("awq", "gptq"):  # a 4-bit copy of the checkpoint in that format, made here
            from vlserve.tools.int4_export import export_int4

            cmd[cmd.index("--model") + 1] = str(export_int4(args.model, Path(tempfile.mkdtemp()) / quant, quant))
        commands[name] = (cmd, None)
    if args.vllm_venv:
        commands["vLLM-CPU"] = ([str(args.vllm_venv / "bin" / "python"), str(ROOT / "benchmarks" /
                                 "peer_vllm_cpu.py"), *common], vllm_env(args.vllm_venv))
    rows: dict[str, dict | None] = {name: None for name in commands}
    for _ in range(args.rounds):
        for name, (cmd, env) in commands.items():
            rows[name] = best_of(rows[name], in_subprocess(cmd, env, name))

    work_tokens = sum(w["max_tokens"] for w in make_workload(args.num_requests))
    elt = torch.empty((), dtype=dtype).element_size()
    offline_bound = decode_bound = ttft_bound = None
    prefill_bound = flops[dtype] / (2 * active_lm_params(args.model))  # linears only: attention adds ~10% at 410
    for name, r in rows.items():
        if not r:
            continue
        quant = name.split(" ", 1)[1] if " " in name else "none"
        if "offline_seconds" in r:
            r["offline_tok_s"] = r["offline_output_tokens"] / r["offline_seconds"]
            tokens_per_out = (r["offline_output_tokens"] + r["offline_prompt_tokens"]) / r["offline_output_tokens"]
            offline_bound = flops[dtype] / (2 * active_lm_params(args.model) * tokens_per_out)
        wb = QUANTIZED_WEIGHT_BYTES.get(quant) or elt
        r["decode_bound"] = bandwidth / decode_bytes_per_token(args.model, wb, head_bytes(quant, elt))
        decode_bound = decode_bound or r["decode_bound"]
        patches = (448 // cfg.vision.patch_size) ** 2
        lm_tokens = patches // cfg.vision.spatial_merge_size**2 + 20
        ttft_bound = (vision_flops_per_patch(args.model) * patches + 2 * active_lm_params(args.model) * lm_tokens) \
            / flops[dtype]

    print(f"\nworkload: {args.num_requests} requests, one picture each, {work_tokens} output tokens; bounds: offline "
          f"= GEMM rate / LM FLOPs per output token (prompt tokens included); decode = read GB/s / weight bytes "
          f"per token; TTFT = ViT + LM prefill FLOPs / GEMM rate; prefill = GEMM rate / LM FLOPs per token")
    base = rows.get("vLLM-CPU")
    print(f"{'engine':<16}{'offline tok/s':>14}{'decode tok/s':>14}{'TTFT 448 ms':>13}{'prefill tok/s':>15}"
          f"   vs vLLM-CPU (off/dec/ttft/prefill)")
    for name, r in rows.items():
        if not r:
            print(f"{name:<16}{'failed':>14}")
            continue
        off, dec, ttft, pre = (r.get(k) for k in ("offline_tok_s", "decode_tok_s", "ttft_448_s", "prefill_tok_s"))
        line = f"{name:<16}{off or 0:>14.1f}{dec or 0:>14.1f}{(ttft or 0) * 1e3:>13.0f}{pre or 0:>15.0f}"
        if base and r is not base:
            ratios = [(a / b if a and b else 0) for a, b in ((off, base.get("offline_tok_s")),
                                                             (dec, base.get("decode_tok_s")),
                                                             (base.get("ttft_448_s"), ttft),
                                                             (pre, base.get("prefill_tok_s")))]
            line += "   " + " / ".join(f"{x:.2f}x" for x in ratios) + " (TTFT: theirs / ours)"
        print(line)
    print(f"{'machine bound':<16}{offline_bound or 0:>14.1f}{decode_bound or 0:>14.1f}{(ttft_bound or 0) * 1e3:>13.0f}"
          f"{prefill_bound:>15.0f}   (decode bound for {dtype_name} weights)")
    for name, r in rows.items():
        if r and offline_bound:
            parts = [f"offline {100 * r.get('offline_tok_s', 0) / offline_bound:.0f}%",
                     f"decode {100 * r.get('decode_tok_s', 0) / r['decode_bound']:.0f}% of its "
                     f"{r['decode_bound']:.0f} tok/s bound"]
            if r.get("ttft_448_s"):
                parts.append(f"TTFT bound/ours {100 * ttft_bound / r['ttft_448_s']:.0f}%")
            if r.get("prefill_tok_s"):
                parts.append(f"prefill {100 * r['prefill_tok_s'] / prefill_bound:.0f}%")
            print(f"  {name:<14}: " + ", ".join(parts))
    if "vlserve" in rows and rows["vlserve"]:
        for name, r in rows.items():
            if r and name.startswith("vlserve ") and r.get("decode_tok_s"):
                print(f"  {name} batch-1 decode = {r['decode_tok_s'] / rows['vlserve']['decode_tok_s']:.2f}x "
                      f"unquantized vlserve")


if __name__ == "__main__":
    main()
