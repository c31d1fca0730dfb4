"""Batch-1 decode with the model's weights and KV cache in 4 KiB pages against the same in 2 MiB pages
(vlserve/model/huge_pages.py), in one process: the model loads with huge pages off, a second copy of every tensor
is made in a huge-page arena, and the decode runs switch the tensors between the two copies (the same values,
the same kernels; only the pages differ), alternating, so the machine's moments fall on both alike.

    .venv/bin/python benchmarks/huge_pages.py [--model medium] [--quantization int8] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ["VLSERVE_HUGE_PAGES"] = "0"  # load in small pages; the huge copy is made below

import torch  # noqa: E402

from vlserve import LLM, SamplingParams  # noqa: E402
from vlserve.model import huge_pages  # noqa: E402


def two_copies(model: torch.nn.Module, kv_caches: list) -> list[tuple[torch.Tensor, tuple, tuple]]:
    """For each tensor: (the tensor, where it is now, where its huge-page copy is), as set_ arguments."""
    tensors = huge_pages._module_tensors(model)
    tensors += [c for c in kv_caches if isinstance(c, torch.Tensor)]
    total = sum(-(-t.untyped_storage().nbytes() // 64) * 64 for t in tensors)
    whole, pos, out, copies = huge_pages.arena(total), 0, [], {}
    for t in tensors:
        old = t.untyped_storage()
        if old.data_ptr() not in copies:
            whole[pos:pos + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            copies[old.data_ptr()] = whole.storage_offset() + pos
            pos += -(-old.nbytes() // 64) * 64
        at = copies[old.data_ptr()]
        out.append((t, (old, t.storage_offset(), t.shape, t.stride()),
                    (whole.untyped_storage(), at // t.element_size() + t.storage_offset(), t.shape, t.stride())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="medium", help="small, medium or a checkpoint folder")
    ap.add_argument("--quantization", default="int8", help="none, or as `vlserve serve --quantization`")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    mode = huge_pages.THP_MODE.read_text().strip() if huge_pages.THP_MODE.exists() else "absent"
    model = args.model
    if model in ("small", "medium"):
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="huge-pages-")) / model, arch="qwen2_vl",
                                    size=model, seed=0))
    quant = None if args.quantization == "none" else args.quantization
    llm = LLM(model, dtype=args.dtype, quantization=quant, max_model_len=4096)
    shard = llm.engine.core.runner.executor
    pairs = two_copies(shard.model, shard.kv_caches)

    def use(copy: int) -> None:
        for t, small, huge in pairs:
            t.set_(*(small, huge)[copy])

    params, first = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), SamplingParams(max_tokens=1)
    prompt = "hello " * 40

    def per_token_ms() -> float:
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        whole = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        return (whole - (time.perf_counter() - t)) / 63 * 1000

    for copy in (0, 1):
        use(copy)
        per_token_ms()  # warm
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.rounds):
        for copy in (0, 1):
            use(copy)
            times[copy].append(per_token_ms())
    small, huge = statistics.median(times[0]), statistics.median(times[1])
    print(f"{args.model} {args.dtype} quantization {args.quantization}, batch-1 decode of 64 tokens, "
          f"{args.rounds} rounds alternating; transparent_hugepage: {mode}")
    print(f"4 KiB pages {small:.2f} ms a token, 2 MiB pages {huge:.2f} ms a token: {small / huge:.3f}x faster")
    print("rounds (4K / 2M):", ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(times[0], times[1])))


if __name__ == "__main__":
    main()
