"""What linear-attention state snapshots buy a hybrid model (Qwen3.5): time to first token of a second, third, ...
question on a picture already asked about, with prefix caching (snapshots) vs without it, and vs prefix caching
with no snapshots (--max-state-snapshots 0: the KV blocks are cached but no hit can resume).

The encoder cache is on in every configuration, so the picture is encoded once either way: the difference is the
language model's prefill of the shared prefix (system prompt + picture).

    .venv/bin/python benchmarks/hybrid_prefix_cache.py [--model DIR | --size medium] [--pictures 4] [--questions 4]
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
QUESTIONS = ["What is in this picture?", "List the colours you see.", "Is there any text in it?",
             "Tell a short story about it.", "Where could it have been taken?", "What is in the top left corner?"]
CONFIGS = {  # name -> engine arguments
    "snapshots": {},
    "no prefix caching": {"enable_prefix_caching": False},
    "snapshots 0": {"max_state_snapshots": 0},
}


def picture(seed: int, size: int) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def ask(llm: LLM, img: Image.Image, question: str) -> float:
    prompt = f"{SYSTEM}<|im_start|>user\n{IMG}{question}<|im_end|>\n<|im_start|>assistant\n"
    t0 = time.perf_counter()
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": [img]}},
                 SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


def measure(model: str, base: dict, pictures: int, questions: int, size: int) -> dict[str, dict]:
    """Every configuration's engine at once, asked in turn (same picture, same question), so that whatever else
    the machine does at the time weighs on them alike."""
    llms = {name: LLM(model, **base, **extra) for name, extra in CONFIGS.items()}
    first: dict[str, list[float]] = {name: [] for name in llms}
    repeat: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():
        ask(llm, picture(0, size), "warm up")  # first-call costs out of the way
    for p in range(pictures):
        img = picture(100 + p, size)
        for q in range(questions):
            for name, llm in llms.items():
                (repeat if q else first)[name].append(ask(llm, img, QUESTIONS[q % len(QUESTIONS)]))
    rows = {}
    for name, llm in llms.items():
        m = llm.get_metrics()
        rows[name] = {"first": statistics.median(first[name]), "repeat": statistics.median(repeat[name]),
                      "hits": m["state_snapshot_hits_total"], "queries": m["state_snapshot_queries_total"],
                      "cached": m["prefix_cache_hits_total"], "prompt": m["prefix_cache_queries_total"]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen3.5 checkpoint (default: a random one of --size)")
    ap.add_argument("--arch", default="qwen3_5", choices=("qwen3_5", "qwen3_5_moe"))
    ap.add_argument("--size", default="medium", help="make-tiny-model size of the random checkpoint")
    ap.add_argument("--pictures", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4, help="questions per picture (the first one misses)")
    ap.add_argument("--picture-size", type=int, default=448, help="pixels per side")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="running state slots (one request at a time here)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="per engine (three are loaded at once)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "ckpt", arch=args.arch, size=args.size))
    base = {"device": args.device, "dtype": args.dtype, "max_model_len": 8192, "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory_gb": args.kv_cache_memory_gb}
    rows = measure(model, base, args.pictures, args.questions, args.picture_size)
    ref = rows["no prefix caching"]
    print(f"\nmodel {model} ({args.arch}, {args.size if args.model is None else 'given'}), device {args.device}, "
          f"{args.pictures} pictures x {args.questions} questions, {args.picture_size}px")
    print(f"{'configuration':<20}{'TTFT first (ms)':>17}{'TTFT repeat (ms)':>18}{'vs no caching':>15}"
          f"{'snapshot hits':>15}{'cached tokens':>15}")
    for name, r in rows.items():
        print(f"{name:<20}{r['first'] * 1e3:>17.1f}{r['repeat'] * 1e3:>18.1f}{ref['repeat'] / r['repeat']:>14.2f}x"
              f"{r['hits']:>8}/{r['queries']:<6}{r['cached']:>8}/{r['prompt']:<6}")


if __name__ == "__main__":
    main()
