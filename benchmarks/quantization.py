"""Quantization: prefill and batch-1 decode speed, and quality against the unquantized model, in one run.

For each method (none; int8 made at load time, with its activations quantized as it runs by default on CPU: per
row for prefill, per 32 values in decode; the same int8 weight-only, `VLSERVE_INT8_ACTIVATIONS=0`; AWQ and GPTQ
4-bit copies exported here by vlserve.tools.int4_export): prefill tok/s (24 fresh text prompts), batch-1 decode
tok/s beside the memory-bandwidth bound of its weight bytes, and quality over a few hundred positions of teacher-forced text:
cosine of the logits, their largest deviation (over the largest reference logit), mean KL divergence of the
next-token distributions and top-1 agreement with the unquantized model, each text in one prefill; then KL and
top-1 again with the text in 8-token passes (the decode kernels' arithmetic: int8's dot products).

    .venv/bin/python benchmarks/quantization.py [--model DIR] [--methods int8,int8-wo,awq,gptq] [--positions 384]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_bounds import QUANTIZED_WEIGHT_BYTES, decode_bytes_per_token, head_bytes, read_bandwidth  # noqa: E402
from picture_workload import run_phases  # noqa: E402

from vlserve import LLM, SamplingParams  # noqa: E402
from vlserve.model.hardware import detect  # noqa: E402
from vlserve.model.hf_config import load_model_config  # noqa: E402
from vlserve.model.layers import int8_gemm  # noqa: E402
from vlserve.tools.logit_quality import deviation, random_sequences, teacher_forced_logits  # noqa: E402

WEIGHT_ONLY = "int8-wo"  # int8 weights, activations in the compute dtype on every path
DECODE_ROWS = 8  # tokens a pass for the decode-path quality (int8: the decode kernels' dot products)


def activations_switch(method: str) -> None:
    """The int8 activation switch for `method` (it is read once per process: asked again here)."""
    os.environ[int8_gemm.ENV_SWITCH] = "0" if method == WEIGHT_ONLY else "1"
    int8_gemm.clear_cached_choices()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="int8,int8-wo,awq,gptq")
    ap.add_argument("--positions", type=int, default=384)
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    from vlserve.model.hardware import resolve_dtype

    cfg = load_model_config(args.model)
    dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype, torch.device("cpu"), announce=False)
    dtype_name = str(dtype).removeprefix("torch.")
    bandwidth = read_bandwidth()
    activations_switch("int8")
    print(f"machine: {detect().describe()}, {torch.get_num_threads()} threads; dtype {dtype_name}; memory read "
          f"{bandwidth / 1e9:.1f} GB/s; int8 activations for prefill: {int8_gemm.activation_bits()}-bit codes")
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    folders = {m: args.model for m in methods}
    for m in methods:
        if m in ("awq", "gptq"):
            from vlserve.tools.int4_export import export_int4

            folders[m] = str(export_int4(args.model, Path(tempfile.mkdtemp()) / m, m))
    sequences = random_sequences(cfg.text.vocab_size, args.positions)
    elt = torch.empty((), dtype=dtype).element_size()
    results = {}
    for m in methods:
        activations_switch(m)
        load_as = "int8" if m == WEIGHT_ONLY else m
        extra = {"quantization": "int8"} if load_as == "int8" else {}
        llm = LLM(folders[m], dtype=dtype_name, kv_cache_memory_gb=0.5, max_model_len=4096, **extra)
        speed = run_phases(llm, SamplingParams, [], args.decode_tokens, phases=("decode", "prefill"))
        del llm
        gc.collect()
        logits = [teacher_forced_logits(folders[m], None if m == "none" else load_as, dtype_name, sequences, rows)
                  for rows in (None, DECODE_ROWS)]
        bound = bandwidth / decode_bytes_per_token(args.model, QUANTIZED_WEIGHT_BYTES.get(load_as, elt),
                                                   head_bytes(load_as, elt))
        results[m] = (speed, bound, logits)
        gc.collect()
    activations_switch("int8")
    base_speed, _, base_logits = results["none"]
    print(f"\n{'method':<9}{'prefill tok/s':>14}{'vs none':>9}{'decode tok/s':>14}{'bound':>7}{'% bound':>9}"
          f"{'vs none':>9}{'logit cos':>11}{'max dev':>9}{'KL mean':>10}{'top-1':>8}{'decode KL':>11}{'top-1':>8}"
          f"   ({base_logits[0].shape[0]} positions; decode: {DECODE_ROWS}-token passes)")
    for m, (speed, bound, logits) in results.items():
        d, dd = deviation(logits[0], base_logits[0]), deviation(logits[1], base_logits[0])
        print(f"{m:<9}{speed['prefill_tok_s']:>14.0f}{speed['prefill_tok_s'] / base_speed['prefill_tok_s']:>8.2f}x"
              f"{speed['decode_tok_s']:>14.1f}{bound:>7.0f}{100 * speed['decode_tok_s'] / bound:>8.0f}%"
              f"{speed['decode_tok_s'] / base_speed['decode_tok_s']:>8.2f}x{d.cosine:>11.4f}"
              f"{d.max_abs_relative:>9.3f}{d.kl_mean:>10.5f}{100 * d.top1_agreement:>7.1f}%{dd.kl_mean:>11.5f}"
              f"{100 * dd.top1_agreement:>7.1f}%")


if __name__ == "__main__":
    main()
