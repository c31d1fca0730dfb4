"""What the encoder cache and the prefix cache buy, measured in one run on the same engine settings.

1. Time to first token for a picture seen before (hit) vs a new picture (miss), same prompt otherwise.
2. Throughput with caches on vs off for a workload with repeated pictures and a shared system prompt, measured
   --repeats times (on and off alternating, fresh pictures each time): the median speed-up and its spread
   (min-max). A spread that includes 1.0x means no difference this run can tell from noise.

    .venv/bin/python benchmarks/cache_effect.py [--model DIR] [--num-requests 24] [--repeats 3]

Without --model a random checkpoint (--size, default medium: ~460 MB) is made in a temporary folder that is
removed at the end, also when the run fails or is interrupted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlserve import LLM, SamplingParams  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = ("<|im_start|>system\nYou are a careful assistant that describes pictures for blind users. Mention "
          "colours, objects, text and the layout of the scene, and say when you are unsure.<|im_end|>\n")


def picture(seed: int, size=(448, 448)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def prompt(question: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{IMG}{question}<|im_end|>\n<|im_start|>assistant\n"


def time_to_first_token(llm: LLM, img: Image.Image, question: str) -> float:
    t0 = time.perf_counter()
    llm.generate({"prompt": prompt(question), "multi_modal_data": {"image": [img]}},
                 SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


def ttft(llm: LLM, rounds: int) -> tuple[float, float]:
    misses, hits = [], []
    for r in range(rounds):
        img = picture(1000 + r)
        misses.append(time_to_first_token(llm, img, "What is in this picture?"))
        hits.append(time_to_first_token(llm, img, "What is in this picture?"))
    return statistics.median(misses), statistics.median(hits)


def throughput(llm: LLM, n: int, seed: int = 2000) -> tuple[float, int]:
    """Seconds and tokens for n requests over n // 3 pictures (from `seed`: each repeat gets fresh ones)."""
    pictures = [picture(seed + i, [(448, 448), (336, 252), (224, 224)][i % 3]) for i in range(max(2, n // 3))]
    questions = ["Describe the picture.", "List the colours you see.", "Is there text?", "Tell a story about it."]
    reqs = [{"prompt": prompt(questions[i % 4]), "multi_modal_data": {"image": [pictures[i % len(pictures)]]}}
            for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def spread(values: list[float]) -> str:
    """`median 1.23x (min 1.01x - max 1.40x over 3 repeats)`, with a word when the spread includes 1.0x."""
    med, lo, hi = statistics.median(values), min(values), max(values)
    text = f"median {med:.2f}x (min {lo:.2f}x - max {hi:.2f}x over {len(values)} repeat{'s' * (len(values) != 1)})"
    if len(values) == 1:
        return text + "; one repeat: no spread, so no telling it from noise (--repeats 3)"
    if lo <= 1.0 <= hi:
        return text + "; the spread includes 1.0x: no difference this run can tell from noise"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a random Qwen2-VL of --size, made in a temporary "
                    "folder removed at the end)")
    ap.add_argument("--size", default="medium", choices=("tiny", "small", "medium"),
                    help="size of the random checkpoint without --model (default: medium)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="TTFT hit/miss pairs (default: 3)")
    ap.add_argument("--repeats", type=int, default=3, help="throughput measurements with caches on and off, "
                    "alternating (default: 3)")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's where this CPU computes it natively, "
                    "else float32")
    args = ap.parse_args()
    if args.repeats < 1 or args.rounds < 1 or args.num_requests < 1:
        ap.error("--repeats, --rounds and --num-requests must be at least 1")
    if args.model is not None:
        run(args, args.model)
        return
    from vlserve.tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="vlserve-cache-effect-") as tmp:  # removed whatever happens below
        run(args, str(make_tiny_model(Path(tmp) / args.size, arch="qwen2_vl", size=args.size)))


def run(args: argparse.Namespace, model: str) -> None:
    common = {"dtype": args.dtype, "max_num_seqs": 32, "kv_cache_memory_gb": 1.0}
    cached = LLM(model, **common)
    time_to_first_token(cached, picture(7), "warm-up")
    miss, hit = ttft(cached, args.rounds)
    print(f"TTFT (448x448, median of {args.rounds}): miss {miss * 1e3:7.1f} ms   hit {hit * 1e3:7.1f} ms   "
          f"hit/miss = {hit / miss:.2f}x (target <= 0.3x)")

    plain = LLM(model, enable_prefix_caching=False, encoder_cache_size=0, **common)
    time_to_first_token(plain, picture(7), "warm-up")
    on, off, ratios = [], [], []
    before = cached.get_metrics()
    for r in range(args.repeats):  # alternating, so a machine that slows down or speeds up hits both alike
        dt_on, tok = throughput(cached, args.num_requests, seed=2000 + 1000 * r)
        dt_off, _ = throughput(plain, args.num_requests, seed=2000 + 1000 * r)
        on.append(tok / dt_on)
        off.append(tok / dt_off)
        ratios.append(dt_off / dt_on)
    m = {k: v - before.get(k, 0) for k, v in cached.get_metrics().items() if isinstance(v, (int, float))}
    print(f"throughput, {args.num_requests} requests, repeated pictures + shared system prompt, "
          f"{args.repeats} repeat(s):")
    print(f"  caches on : median {statistics.median(on):7.1f} tok/s (min {min(on):.1f} - max {max(on):.1f})   "
          f"prefix hits {m.get('prefix_cache_hits_total', 0):.0f}/{m.get('prefix_cache_queries_total', 0):.0f} "
          f"tokens, encoder hits {m.get('encoder_cache_hits_total', 0):.0f}/"
          f"{m.get('encoder_cache_queries_total', 0):.0f} items")
    print(f"  caches off: median {statistics.median(off):7.1f} tok/s (min {min(off):.1f} - max {max(off):.1f})")
    print(f"  speed-up with caches: {spread(ratios)}")


if __name__ == "__main__":
    main()
