"""Offline throughput: vlserve vs transformers `generate` on the same mixed picture workload, same run.

Workload: requests with one picture each (several sizes, some pictures repeated), prompts and output lengths
that vary. transformers runs static batches (left-padded, every batch generates until its longest request is
done; only each request's own tokens are counted) at a few batch sizes and we report its best.

    .venv/bin/python benchmarks/offline_throughput.py [--model DIR | --arch qwen3_vl_moe] [--num-requests 24]

The machine's bound printed beside them: this CPU's measured GEMM rate in the chosen dtype divided by the FLOPs a
token needs in the language model (2 x its active parameters: a MoE token touches only its top-k experts), for
every prompt and output token, as output tokens per second. It leaves out attention and the vision tower, so no
engine can reach it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_bounds import active_lm_params, gemm_flops  # noqa: E402
from picture_workload import make_workload  # noqa: E402

from vlserve.model.hardware import detect, resolve_dtype  # noqa: E402
from vlserve.model.hf_config import load_model_config  # noqa: E402


def run_vlserve(model: str, work: list[dict], dtype: str, **engine_args) -> tuple[float, int, int]:
    """Seconds, output tokens, prompt tokens."""
    from vlserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine_args)
    warm = make_workload(2, seed=99)  # warm-up on other pictures (so no cache could help the timed run)
    llm.generate([{"prompt": w["prompt"], "multi_modal_data": {"image": [w["image"]]}} for w in warm],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt": w["prompt"], "multi_modal_data": {"image": [w["image"]]}} for w in work]
    params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), sum(len(o.prompt_token_ids) for o in outs)


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A static batch as transformers' generate wants it: ids left-padded to the longest, and their mask."""
    longest = max(map(len, seqs))
    input_ids = torch.tensor([[pad] * (longest - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (longest - len(s)) + [1] * len(s) for s in seqs])
    return input_ids, mask


class HFRunner:
    def __init__(self, model: str, dtype: torch.dtype):
        import transformers
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        arch = AutoConfig.from_pretrained(model).architectures[0]  # the class transformers names in config.json
        self.model = getattr(transformers, arch).from_pretrained(model, dtype=dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(model)
        self.ip = Qwen2VLImageProcessorPil.from_pretrained(model)
        self.image_token = self.model.config.image_token_id

    @torch.no_grad()
    def generate_batch(self, batch: list[dict]) -> int:
        proc = self.ip(images=[w["image"] for w in batch], return_tensors="pt")
        counts = iter((proc["image_grid_thw"].prod(-1) // 4).tolist())
        seqs = []
        for w in batch:
            ids = self.tok.encode(w["prompt"])
            seqs.append([t for tok in ids for t in ([tok] * next(counts) if tok == self.image_token else [tok])])
        pad = self.tok.pad_token_id
        input_ids, mask = left_pad(seqs, pad)
        new = max(w["max_tokens"] for w in batch)
        self.model.generate(input_ids=input_ids, attention_mask=mask, pixel_values=proc["pixel_values"],
                            image_grid_thw=proc["image_grid_thw"], mm_token_type_ids=(input_ids == self.image_token).int(),
                            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
        return sum(w["max_tokens"] for w in batch)  # what the users asked for; the padding tokens are waste

    def run(self, work: list[dict], batch_size: int) -> tuple[float, int]:
        self.generate_batch(make_workload(2, seed=99)[:batch_size])  # warm-up
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(work), batch_size):
            tokens += self.generate_batch(work[i : i + batch_size])
        return time.perf_counter() - t0, tokens


def resolved_dtype(model: str, dtype: str) -> torch.dtype:
    """vlserve's own rule for `dtype`, so transformers runs in exactly the dtype vlserve picked."""
    return resolve_dtype(dtype, load_model_config(model).checkpoint_dtype, torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--arch", default="qwen2_vl")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--hf-batch-sizes", default="4,8")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's where this CPU computes it natively, "
                    "else float32 (both engines get the same)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch=args.arch, size="medium"))
    work = make_workload(args.num_requests)
    dtype = str(resolved_dtype(model, args.dtype)).removeprefix("torch.")
    print(f"workload: {len(work)} requests, one picture each, {sum(w['max_tokens'] for w in work)} output tokens; "
          f"dtype {args.dtype} -> {dtype} ({detect().describe()}), {torch.get_num_threads()} threads")

    dt, tokens, prompt_tokens = run_vlserve(model, work, dtype, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=1.0)
    ours = tokens / dt
    print(f"vlserve        : {tokens} tokens in {dt:6.2f}s = {ours:7.1f} tok/s  ({len(work) / dt:.2f} req/s)")
    flops, active = gemm_flops(getattr(torch, dtype)), active_lm_params(model)
    bound = flops / (2 * active) * tokens / (tokens + prompt_tokens)  # prompt tokens cost the same FLOPs
    print(f"machine bound  : {flops / 1e9:.0f} GFLOP/s GEMM / (2 x {active / 1e6:.0f}M active LM params x "
          f"{(tokens + prompt_tokens) / tokens:.1f} tokens per output token) = {bound:7.1f} tok/s; "
          f"vlserve at {100 * ours / bound:.0f}% of it")
    if args.skip_hf:
        return
    hf = HFRunner(model, getattr(torch, dtype))
    best = 0.0
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        dt, tokens = hf.run(work, bs)
        print(f"transformers b={bs:<3}: {tokens} tokens in {dt:6.2f}s = {tokens / dt:7.1f} tok/s")
        best = max(best, tokens / dt)
    print(f"ratio vlserve / best transformers = {ours / best:.2f}x")


if __name__ == "__main__":
    main()
