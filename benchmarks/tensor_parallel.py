"""Tensor parallelism on this machine: one rank against two, in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--model DIR] [--num-requests 16] [--rounds 3]

Three measurements, each for TP=1 (one process, every core), TP=2 with the vision tower split like the LM
(`--mm-encoder-tp-mode weights`) and TP=2 with the data-parallel encoder (`data`); at TP=2 each rank owns half
of the cores:
- offline throughput on the mixed picture workload (output tokens/s; the compute bound beside it is this CPU's
  GEMM rate over 2 x the LM's parameters per token, the same for every setup: the ranks share the same cores);
- batch-1 decode (tokens/s; every step pays two all-reduces per layer at two ranks);
- the vision tower alone on a batch of pictures of mixed sizes, as the engine runs it (patches/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_bounds import active_lm_params, gemm_flops  # noqa: E402
from picture_workload import DECODE_PROMPT, chat_prompt, make_workload, picture  # noqa: E402

from vlserve import LLM, SamplingParams  # noqa: E402
from vlserve.model.hardware import detect  # noqa: E402
from vlserve.tools.tiny_model import make_tiny_model  # noqa: E402

SETUPS = [("TP=1", 1, "weights"), ("TP=2 weights", 2, "weights"), ("TP=2 data", 2, "data")]
MIXED_SIZES = [(896, 672), (448, 448), (224, 224), (672, 336), (336, 336), (1008, 448), (280, 280), (560, 420)]


def offline(llm: LLM, work: list[dict]) -> tuple[float, int]:
    prompts = [{"prompt": w["prompt"], "multi_modal_data": {"image": [w["image"]]}} for w in work]
    params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_rate(llm: LLM, tokens: int = 64) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([DECODE_PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([DECODE_PROMPT], params, use_tqdm=False)
    return tokens / (time.perf_counter() - t0)


def encoder_rate(llm: LLM, rounds: int) -> tuple[float, int]:
    """Patches per second of the engine's vision step over pictures of mixed sizes (median of `rounds`)."""
    processor = llm.engine.input_processor
    items = []
    for i, size in enumerate(MIXED_SIZES):
        p = processor.process({"prompt": chat_prompt("?"), "multi_modal_data": {"image": [picture(*size, 500 + i)]}})
        items += p.mm_items
    patches = sum(it.pixel_values.shape[0] for it in items)
    vision = llm.engine.core.runner.vision
    times = []
    for _ in range(rounds + 1):  # the first round warms up
        vision.outputs.clear()
        t0 = time.perf_counter()
        vision.encode(items)
        times.append(time.perf_counter() - t0)
    vision.outputs.clear()
    return patches / statistics.median(times[1:]), patches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {detect().describe()}, {cores} cores; model {model}")
    work = make_workload(args.num_requests)
    results = {}
    for name, tp, mode in SETUPS:
        llm = LLM(model, dtype=args.dtype, tensor_parallel_size=tp, mm_encoder_tp_mode=mode)
        dtype = llm.config.dtype
        offline(llm, make_workload(2, seed=99))  # warm-up on other pictures
        seconds, tokens = offline(llm, work)
        results[name] = {"tok/s": tokens / seconds, "decode": decode_rate(llm), "patches/s": encoder_rate(
            llm, args.rounds)[0]}
        llm.shutdown()
        del llm
        print(f"  {name}: done", flush=True)
    bound = gemm_flops(dtype) / (2 * active_lm_params(model))
    base = results["TP=1"]
    print(f"\n{dtype}, {args.num_requests} picture requests; compute bound of the LM: {bound:.0f} tok/s "
          "(every setup shares the same cores)")
    print(f"{'setup':<14} {'offline tok/s':>14} {'vs TP=1':>8} {'batch-1 decode tok/s':>21} {'vs TP=1':>8} "
          f"{'vision patches/s':>17} {'vs TP=1':>8}")
    for name, r in results.items():
        ratio = {key: r[key] / base[key] for key in r}
        print(f"{name:<14} {r['tok/s']:>14.1f} {ratio['tok/s']:>7.2f}x {r['decode']:>21.1f} {ratio['decode']:>7.2f}x "
              f"{r['patches/s']:>17.0f} {ratio['patches/s']:>7.2f}x")
    print(f"offline at TP=1: {base['tok/s'] / bound:.0%} of the compute bound")


if __name__ == "__main__":
    main()
