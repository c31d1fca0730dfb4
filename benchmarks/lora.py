"""Multi-LoRA throughput: one batch mixing 4 adapters against the base model alone, same run.

The offline picture workload (benchmarks/picture_workload.py) runs four ways, each timed after a warm-up on other
pictures:
  base        the model without --enable-lora
  base+lora   the same requests on an engine with --enable-lora and no adapter named (the cost of the wrappers)
  mixed       every request with one of 4 adapters (language model and towers, rank 16), round robin, one call
  merged      each adapter merged into its own copy of the checkpoint, the four quarters one after another
              (what serving the fine-tunes without LoRA would cost: one model at a time)
The goal is mixed >= 0.8x base.

    .venv/bin/python benchmarks/lora.py [--model DIR] [--num-requests 24] [--rank 16] [--targets both]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from picture_workload import _inputs, make_workload  # noqa: E402

from tests.lora_utils import make_peft_adapter, merge_adapter  # noqa: E402
from vlserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from vlserve.model.hardware import detect  # noqa: E402

ADAPTERS = 4


def timed(llm: LLM, work: list[dict], loras=None) -> tuple[float, int]:
    """Seconds and output tokens of the workload in one generate call, after a warm-up on other pictures."""
    params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
    warm = make_workload(len(work), seed=97)
    llm.generate(_inputs(warm), params, use_tqdm=False, lora_request=loras)
    t0 = time.perf_counter()
    outs = llm.generate(_inputs(work), params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen2-VL-family checkpoint (default: a random medium Qwen2-VL made here)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="both", choices=("lm", "tower", "both"))
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if args.model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(tmp / "medium", arch="qwen2_vl", size="medium"))
    ckpt = Path(args.model)
    adapters = [make_peft_adapter(ckpt, tmp / f"adapter{i}", targets=args.targets, rank=args.rank, seed=i)
                for i in range(ADAPTERS)]
    work = make_workload(args.num_requests)
    engine = dict(dtype=args.dtype, max_num_seqs=32)
    rows = {}

    llm = LLM(str(ckpt), **engine)
    rows["base"] = timed(llm, work)
    llm.shutdown()
    del llm

    llm = LLM(str(ckpt), enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank, **engine)
    rows["base+lora"] = timed(llm, work)
    loras = [LoRARequest(f"a{i % ADAPTERS}", i % ADAPTERS + 1, str(adapters[i % ADAPTERS])) for i in range(len(work))]
    rows["mixed"] = timed(llm, work, loras)
    llm.shutdown()
    del llm

    seconds, tokens = 0.0, 0
    for i, adapter in enumerate(adapters):
        merged = LLM(str(merge_adapter(ckpt, adapter, tmp / f"merged{i}")), **engine)
        s, t = timed(merged, work[i::ADAPTERS])
        seconds, tokens = seconds + s, tokens + t
        merged.shutdown()
        del merged
    rows["merged, one after another"] = (seconds, tokens)

    base = rows["base"][1] / rows["base"][0]
    print(f"\n{detect().describe()}, {args.dtype}, {args.num_requests} requests, {ADAPTERS} adapters "
          f"({args.targets}, rank {args.rank})")
    print("| run | seconds | output tok/s | vs base |")
    print("|---|---|---|---|")
    for name, (s, t) in rows.items():
        print(f"| {name} | {s:.2f} | {t / s:.1f} | {t / s / base:.2f}x |")


if __name__ == "__main__":
    main()
