"""Where a hybrid model's (Qwen3.5) time goes: the share of prefill and of decode spent in the Gated DeltaNet
sequence mixing (the causal conv and the delta rule, pure torch) against the whole model step, to decide whether
that path needs a CPU kernel of its own.

Prefill: prompts of --prompt-tokens text tokens, one at a time, max_tokens 1. Decode: --decode-seqs sequences
decoding --decode-tokens tokens together (their short prompts' prefill subtracted). The delta rule's FLOP rate is
printed beside this machine's fp32 GEMM rate (the bound a kernel could approach). Then the decode step alone at a
released model's head shape: vlserve's fused kernel (in place on the state pool) against the torch path, beside
the memory-traffic bound.

    .venv/bin/python benchmarks/hybrid_layers.py [--model DIR | --size medium] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from vlserve import LLM, SamplingParams
from vlserve.model.families.qwen import qwen3_5_text
from vlserve.model.kernels import cpu_kernels
from vlserve.model.layers import gated_delta

sys.path.insert(0, str(Path(__file__).parent))
from machine_bounds import gemm_flops, read_bandwidth  # noqa: E402

TIMED = ("causal_conv", "chunk_gated_delta", "causal_conv_step", "gated_delta_step_in_pool")


class Timers:
    """Wraps the sequence-mixing functions the decoder calls and sums their wall time."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops = 0.0
        for name in TIMED:
            setattr(qwen3_5_text, name, self._wrap(name, getattr(qwen3_5_text, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.seconds[name] += time.perf_counter() - t0
            if name == "chunk_gated_delta":  # q, k [T, Hk, Dk]; v [T, H, Dv]
                (T, H, Dv), Dk = args[2].shape, args[1].shape[-1]
                c = 64  # per block: k k^T, q k^T, two solves, u - w s, q s, intra v, the state update
                self.flops += 2 * H * T * (3 * c * Dk + c * Dv + 2 * c * (Dk + Dv) + 3 * Dk * Dv)
            return out
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def decode_step_kernel_vs_torch(seqs: int, heads: int = 32, dk: int = 128, dv: int = 128, reps: int = 20):
    """The decode step alone at a released model's head shape (value heads x 128 x 128 fp32 states): vlserve's
    kernel against the torch path, ms per layer, and the memory traffic bound (each state read twice, written
    once)."""
    pool = torch.randn(seqs + 4, heads, dk, dv) * 0.1
    slots, fresh = torch.arange(seqs), torch.zeros(seqs, dtype=torch.bool)
    args = (torch.randn(seqs, heads // 2, dk), torch.randn(seqs, heads // 2, dk), torch.randn(seqs, heads, dv),
            -torch.rand(seqs, heads), torch.rand(seqs, heads))

    def timed() -> float:
        gated_delta.gated_delta_step_in_pool(*args, pool, slots, fresh)
        t0 = time.perf_counter()
        for _ in range(reps):
            gated_delta.gated_delta_step_in_pool(*args, pool, slots, fresh)
        return (time.perf_counter() - t0) / reps

    kernel = timed() if cpu_kernels.for_tensor(pool, (torch.float32,)) is not None else float("nan")
    original, cpu_kernels.for_tensor = cpu_kernels.for_tensor, lambda *a, **k: None
    try:
        torch_s = timed()
    finally:
        cpu_kernels.for_tensor = original
    return kernel, torch_s, 3 * seqs * heads * dk * dv * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen3.5 checkpoint (default: a random one of --size)")
    ap.add_argument("--arch", default="qwen3_5", choices=("qwen3_5", "qwen3_5_moe"))
    ap.add_argument("--size", default="medium")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--decode-seqs", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "ckpt", arch=args.arch, size=args.size))
    llm = LLM(model, dtype=args.dtype, max_model_len=args.prompt_tokens + 64, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, args.prompt_tokens))
    timers = Timers()
    vocab = llm.engine.cfg.model.text.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [{"prompt_token_ids": torch.randint(100, vocab - 100, (length,), generator=g).tolist()}
                for _ in range(n)]

    llm.generate(prompts(1, 64), SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    timers.take()
    t0 = time.perf_counter()
    for p in prompts(args.prompts, args.prompt_tokens):
        llm.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)
    prefill_s, prefill = time.perf_counter() - t0, timers.take()
    delta_flops, timers.flops = timers.flops, 0.0

    short = prompts(args.decode_seqs, 16)
    t0 = time.perf_counter()
    llm.generate(short, SamplingParams(max_tokens=1), use_tqdm=False)
    short_s, short_t = time.perf_counter() - t0, timers.take()
    t0 = time.perf_counter()
    llm.generate(short, SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True), use_tqdm=False)
    decode_s, decode = time.perf_counter() - t0 - short_s, timers.take()
    decode = {k: v - short_t.get(k, 0.0) for k, v in decode.items()}

    rate = gemm_flops(torch.float32)
    print(f"\nmodel {model} ({args.arch}), dtype {llm.engine.cfg.dtype}, {torch.get_num_threads()} threads")
    pre_mix = prefill.get("causal_conv", 0) + prefill.get("chunk_gated_delta", 0)
    print(f"prefill: {args.prompts} x {args.prompt_tokens} tokens in {prefill_s * 1e3:.0f} ms "
          f"({args.prompts * args.prompt_tokens / prefill_s:.0f} tok/s); sequence mixing {pre_mix * 1e3:.0f} ms "
          f"= {pre_mix / prefill_s:.1%} (conv {prefill.get('causal_conv', 0) * 1e3:.0f} ms, delta rule "
          f"{prefill.get('chunk_gated_delta', 0) * 1e3:.0f} ms)")
    delta_s = prefill.get("chunk_gated_delta", 0)
    if delta_s:
        print(f"  delta rule at {delta_flops / delta_s / 1e9:.1f} GFLOP/s; fp32 GEMM bound here "
              f"{rate / 1e9:.1f} GFLOP/s ({delta_flops / delta_s / rate:.0%} of it)")
    dec_mix = decode.get("causal_conv_step", 0) + decode.get("gated_delta_step", 0)
    steps = args.decode_tokens - 1
    print(f"decode: {args.decode_seqs} sequences x {steps} steps in {decode_s * 1e3:.0f} ms "
          f"({decode_s / steps * 1e3:.1f} ms/step); sequence mixing {dec_mix * 1e3:.0f} ms = {dec_mix / decode_s:.1%}")
    bandwidth = read_bandwidth()
    print(f"decode step alone, 32 value heads x 128 x 128 fp32 states (a released model's layer), memory "
          f"{bandwidth / 1e9:.1f} GB/s:")
    for seqs in (1, 8, 32):
        kernel, torch_s, traffic = decode_step_kernel_vs_torch(seqs)
        print(f"  {seqs:>2} sequences: kernel {kernel * 1e3:.2f} ms, torch {torch_s * 1e3:.2f} ms "
              f"(x{torch_s / kernel:.1f}); bound {traffic / bandwidth * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
