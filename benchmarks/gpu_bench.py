"""vlserve on a CUDA GPU beside transformers `generate` on the same GPU, in one run (benchmarks/gpu_check.sh runs
it; on a machine without CUDA it says so and exits).

Per model (a medium random Qwen2-VL, ~240M; a random model with Qwen2.5-VL-3B's shapes, vocabulary aside):
- the offline picture workload (benchmarks/picture_workload.py: pictures of four sizes, 32-96 tokens out each):
  vlserve with CUDA graphs, with --enforce-eager, with graphs and --no-async-scheduling, and transformers (static
  batches, its best batch size);
- batch-1 decode tokens/s: vlserve with and without graphs, and the HBM bound (the LM's weight bytes per token
  over the copy bandwidth measured here);
- the vision tower on 4 pictures of 224x224 and on 1: milliseconds per call with its graphs and without.
Prints a table and writes every number as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_bounds import active_lm_params, decode_bytes_per_token  # noqa: E402
from offline_throughput import HFRunner  # noqa: E402
from picture_workload import make_workload, run_phases  # noqa: E402

# Qwen2.5-VL-3B-Instruct's shapes (its config.json), applied over a medium random checkpoint's files.
QWEN2_5_VL_3B_TEXT = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                      "num_attention_heads": 16, "num_key_value_heads": 2}
QWEN2_5_VL_3B_VISION = {"hidden_size": 1280, "out_hidden_size": 2048, "intermediate_size": 3420, "depth": 32,
                        "num_heads": 16, "fullatt_block_indexes": [7, 15, 23, 31]}


def ceilings(device: torch.device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matrix rate, measured now."""
    def timed(fn, reps):
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / reps

    def copy_rate():
        src = torch.randn(1 << 29, device=device)  # 2 GiB
        dst = torch.empty_like(src)
        return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10)

    def gemm_rate():
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        return 2 * 8192**3 / timed(lambda: a @ b, 10)

    return {"copy_bytes_per_s": copy_rate(), "bf16_flops": gemm_rate()}


def shaped_checkpoint(folder: Path, text: dict, vision: dict, device: torch.device) -> Path:
    """A medium random Qwen2.5-VL's files (tokenizer, processor) with other shapes and new random bf16 weights,
    made on the GPU (minutes faster than transformers' CPU init at billions of parameters)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from vlserve.tools.tiny_model import make_tiny_model

    path = make_tiny_model(folder, arch="qwen2_5_vl", size="medium")
    cfg = AutoConfig.from_pretrained(path)
    for k, v in text.items():
        setattr(cfg.text_config, k, v)
    if getattr(cfg.text_config, "layer_types", None) is not None:  # one entry per layer, checked against the depth
        cfg.text_config.layer_types = ["full_attention"] * cfg.text_config.num_hidden_layers
    for k, v in vision.items():
        setattr(cfg.vision_config, k, v)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if p.dim() == 1:
            t = torch.ones(p.shape, device=device) if "norm" in name or "ln" in name else torch.zeros(p.shape,
                                                                                                  device=device)
        else:
            t = torch.randn(p.shape, device=device, generator=g) * 0.02
        tensors[name] = t.to(torch.bfloat16).cpu()
    for old in path.glob("*.safetensors"):
        old.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    return path


class GpuHFRunner(HFRunner):
    """benchmarks/offline_throughput.py's transformers runner, on the GPU."""

    def __init__(self, model: str, dtype: torch.dtype, device: torch.device):
        super().__init__(model, dtype)
        self.model.to(device)
        self.device = device
        generate = self.model.generate

        def on_device(**kw):
            return generate(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()})

        self.model.generate = on_device

    def run(self, work, batch_size):
        dt, tokens = super().run(work, batch_size)
        torch.cuda.synchronize(self.device)
        return dt, tokens


def vision_ms(llm, device: torch.device, pictures: int, reps: int = 20) -> dict:
    """Milliseconds per vision-tower call on `pictures` 224x224 pictures (16 x 16 patches), graphs and eager."""
    shard = llm.engine.core.runner.executor
    tower = shard.model.visual
    grids = [(1, 16, 16)] * pictures
    pixels = torch.randn(256 * pictures, tower.cfg.patch_dim, device=device, dtype=torch.bfloat16)
    out = {}
    for label, run in (("graphs", shard.vision_graphs), ("eager", None)):
        if label == "graphs" and run is None:
            continue
        with torch.inference_mode():
            for _ in range(3):
                shard.model.encode_images(pixels, grids, run)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                shard.model.encode_images(pixels, grids, run)
            torch.cuda.synchronize(device)
        out[label] = 1e3 * (time.perf_counter() - t0) / reps
    return out


def profile_decode(llm, tokens: int = 200) -> None:
    """Where a batch-1 decode step's host time goes (cProfile, by cumulative time): the GPU waits for it."""
    import cProfile
    import pstats

    from picture_workload import DECODE_PROMPT

    from vlserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([DECODE_PROMPT], params, use_tqdm=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([DECODE_PROMPT], params, use_tqdm=False)
    prof.disable()
    print(f"decode profile: {tokens} tokens at batch 1 in {time.perf_counter() - t0:.3f}s (with the profiler)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


def bench_model(name: str, path: str, work: list[dict], device: torch.device, bw: float, hf_batches: list[int],
                max_num_seqs: int, profile: bool = False) -> dict:
    from vlserve import LLM, SamplingParams

    res: dict = {"model": name}
    for label, eager, overlap in (("graphs", False, True), ("eager", True, True), ("sync", False, False)):
        t0 = time.perf_counter()
        llm = LLM(path, dtype="bfloat16", max_num_seqs=max_num_seqs, kv_cache_memory_gb=8, enforce_eager=eager,
                  async_scheduling=overlap)
        res[f"start_s_{label}"] = time.perf_counter() - t0
        phases = run_phases(llm, SamplingParams, work, decode_tokens=128, phases=("offline", "decode"),
                            warm_offline=True)
        res[f"offline_tok_s_{label}"] = phases["offline_output_tokens"] / phases["offline_seconds"]
        res[f"decode_tok_s_{label}"] = phases["decode_tok_s"]
        if profile and label == "graphs":
            profile_decode(llm)
        if label == "graphs":  # this instance has the vision graphs: time the tower with them and without
            for n in (1, 4):
                for tower_label, ms in vision_ms(llm, device, n).items():
                    res[f"vit_ms_{n}pic_{tower_label}"] = ms
        del llm
        torch.cuda.empty_cache()
    per_token = decode_bytes_per_token(path, 2.0, 2.0)
    res["decode_bound_tok_s"] = bw / per_token
    res["active_lm_params"] = active_lm_params(path)
    best = 0.0
    hf = GpuHFRunner(path, torch.bfloat16, device)
    for bs in hf_batches:
        dt, tokens = hf.run(work, bs)
        res[f"hf_tok_s_b{bs}"] = tokens / dt
        best = max(best, tokens / dt)
    res["hf_best_tok_s"] = best
    del hf
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--hf-batch-sizes", default="8,24")
    ap.add_argument("--models", default="medium,3b", help="which of medium,3b to run")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--profile-decode", action="store_true", help="cProfile batch-1 decode on the first model")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here: nothing measured")
        return
    device = torch.device("cuda")
    tmp = Path(tempfile.mkdtemp())
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    report.update(ceilings(device))
    print(f"{report['device']}: copy {report['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 GEMM "
          f"{report['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    bw = report["copy_bytes_per_s"] / 2  # a decode step reads its weights: count read bytes at half a copy's rate
    work = make_workload(args.num_requests)
    hf_batches = [int(b) for b in args.hf_batch_sizes.split(",")]
    report["models"] = []
    from vlserve.tools.tiny_model import make_tiny_model

    for name in args.models.split(","):
        t0 = time.perf_counter()
        if name == "medium":
            path = str(make_tiny_model(tmp / "medium", arch="qwen2_vl", size="medium"))
            label = "medium random Qwen2-VL (~240M)"
        else:
            path = str(shaped_checkpoint(tmp / "3b", QWEN2_5_VL_3B_TEXT, QWEN2_5_VL_3B_VISION, device))
            label = "random Qwen2.5-VL-3B shapes (vocab 8k)"
        print(f"{label}: checkpoint in {time.perf_counter() - t0:.0f}s", flush=True)
        res = bench_model(label, path, work, device, bw, hf_batches, args.max_num_seqs,
                          profile=args.profile_decode and not report["models"])
        report["models"].append(res)
        print(json.dumps(res, indent=1), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, bf16")
    print("| model | offline tok/s graphs / eager / no async / transformers (ratio) | batch-1 decode tok/s graphs / "
          "eager / no async / HBM bound | ViT ms 1 pic graphs / eager | ViT ms 4 pics graphs / eager |")
    for r in report["models"]:
        print(f"| {r['model']} | {r['offline_tok_s_graphs']:.0f} / {r['offline_tok_s_eager']:.0f} / "
              f"{r['offline_tok_s_sync']:.0f} / {r['hf_best_tok_s']:.0f} "
              f"(x{r['offline_tok_s_graphs'] / r['hf_best_tok_s']:.1f}) | {r['decode_tok_s_graphs']:.0f} / "
              f"{r['decode_tok_s_eager']:.0f} / {r['decode_tok_s_sync']:.0f} / {r['decode_bound_tok_s']:.0f} | "
              f"{r.get('vit_ms_1pic_graphs', float('nan')):.2f} / {r['vit_ms_1pic_eager']:.2f} | "
              f"{r.get('vit_ms_4pic_graphs', float('nan')):.2f} / {r['vit_ms_4pic_eager']:.2f} |")


if __name__ == "__main__":
    main()
