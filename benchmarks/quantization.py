"""Weight-only quantization: batch-1 decode speed and quality against the unquantized model, in one run.

For each method (none, int8 made at load time, AWQ and GPTQ 4-bit copies exported here by
vlserve.tools.int4_export): batch-1 decode tok/s beside the memory-bandwidth bound of its weight bytes, and
quality over a few hundred positions of teacher-forced text: cosine of the logits and top-1 agreement with the
unquantized model.

    .venv/bin/python benchmarks/quantization.py [--model DIR] [--methods int8,awq,gptq] [--positions 384]
"""

from __future__ import annotations

import argparse
import gc
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
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span  # noqa: E402
from vlserve.model.loader import load_model  # noqa: E402
from vlserve.model.quantization import resolve_quantization  # noqa: E402


@torch.inference_mode()
def teacher_forced_logits(folder: str, method: str | None, dtype: str, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Logits at every position of each sequence, one prefill each: [positions, vocab] fp32."""
    cfg = load_model_config(folder)
    model = load_model(Path(folder), cfg, dtype, with_vision=False,
                       quantization=resolve_quantization(method if method in ("int8",) else None, cfg.quantization))
    if hasattr(model, "pack_for_cpu"):
        from vlserve.model.layers.packed_linear import packed_linear_supported

        if packed_linear_supported(torch.device("cpu"), next(model.parameters()).dtype):
            model.pack_for_cpu()
    t = cfg.text
    out = []
    for ids in sequences:
        n = len(ids)
        kv = [torch.zeros(2, n, t.num_kv_heads, t.head_dim, dtype=model.language_model.norm.weight.dtype)
              for _ in range(t.num_layers)]
        meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[build_prefill_span(0, n, n, None)])
        hidden = model(model.embed_tokens(ids), torch.arange(n).expand(3, -1), kv, meta)
        out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="int8,awq,gptq")
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
    print(f"machine: {detect().describe()}, {torch.get_num_threads()} threads; dtype {dtype_name}; memory read "
          f"{bandwidth / 1e9:.1f} GB/s")
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    folders = {m: args.model for m in methods}
    for m in methods:
        if m in ("awq", "gptq"):
            from vlserve.tools.int4_export import export_int4

            folders[m] = str(export_int4(args.model, Path(tempfile.mkdtemp()) / m, m))
    gen = torch.Generator().manual_seed(0)
    per_seq = 128
    sequences = [torch.randint(0, cfg.text.vocab_size, (per_seq,), generator=gen)
                 for _ in range(max(1, args.positions // per_seq))]
    elt = torch.empty((), dtype=dtype).element_size()
    results = {}
    for m in methods:
        extra = {"quantization": m} if m == "int8" else {}
        llm = LLM(folders[m], dtype=dtype_name, kv_cache_memory_gb=0.5, max_model_len=4096, **extra)
        speed = run_phases(llm, SamplingParams, [], args.decode_tokens, phases=("decode",))["decode_tok_s"]
        del llm
        gc.collect()
        logits = teacher_forced_logits(folders[m], None if m == "none" else m, dtype_name, sequences)
        bound = bandwidth / decode_bytes_per_token(args.model, QUANTIZED_WEIGHT_BYTES.get(m, elt), head_bytes(m, elt))
        results[m] = (speed, bound, logits)
        gc.collect()
    base_speed, _, base_logits = results["none"]
    print(f"\n{'method':<8}{'decode tok/s':>14}{'bound':>8}{'% bound':>9}{'vs none':>9}{'logit cos':>11}"
          f"{'top-1 agree':>13}   ({base_logits.shape[0]} positions)")
    for m, (speed, bound, logits) in results.items():
        cos = torch.nn.functional.cosine_similarity(logits, base_logits, dim=-1)
        top1 = (logits.argmax(-1) == base_logits.argmax(-1)).float().mean()
        print(f"{m:<8}{speed:>14.1f}{bound:>8.0f}{100 * speed / bound:>8.0f}%{speed / base_speed:>8.2f}x"
              f"{cos.mean():>11.4f}{100 * top1:>12.1f}%")


if __name__ == "__main__":
    main()
