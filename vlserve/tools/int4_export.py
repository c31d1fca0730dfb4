"""Writes a 4-bit copy of a checkpoint in the exact layouts of released AWQ and GPTQ-Int4 Qwen-VL repos.

No quantized weights can be downloaded here, so tests and benchmarks make their own: round-to-nearest in groups
(AWQ: asymmetric with zero points, as AutoAWQ's "gemm" packing; GPTQ: symmetric, zero 8, AutoGPTQ's original
format that stores zero - 1). The decoder layers' linears are quantized; embeddings, LM head and vision tower
stay as they were (Qwen's AWQ repos leave the vision tower out too).

    python -m vlserve.tools.int4_export SRC DST --method awq [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"^(model\.language_model\.|model\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                    r"\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output channel stored in nibble i of an AutoAWQ word


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool):
    """[N, K] -> q [N, K] ints 0..15, zeros [N, K/group] ints, scales [N, K/group] fp16 (w ~ (q - zero) * scale)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) * 2 / 15).clamp_min(1e-6)
        zero = torch.full_like(scale, 8.0)
    else:
        hi, lo = g.amax(-1), g.amin(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-6)
        zero = (-torch.round(lo / scale)).clamp(0, 15)
    scale = scale.half()
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(n, k).long(), zero.long(), scale


def _words(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] ints 0..15 -> [...] int32, value j at bits 4j (two's complement wrap for the top nibble)."""
    word = sum(values[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    order = list(AWQ_ORDER)
    qt = q.t().contiguous()  # [K, N]
    zt = zeros.t().contiguous()  # [G, N]
    return {"qweight": _words(qt.view(qt.shape[0], -1, 8)[..., order]),
            "qzeros": _words(zt.view(zt.shape[0], -1, 8)[..., order]),
            "scales": scales.t().contiguous()}


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = q.shape
    qt = q.t().contiguous().view(k // 8, 8, n).permute(0, 2, 1)  # [K/8, N, 8]: input channels 8i + j
    zt = (zeros - 1).t().contiguous()  # the original GPTQ format stores zero - 1
    return {"qweight": _words(qt), "qzeros": _words((zt & 15).view(zt.shape[0], -1, 8)),
            "scales": scales.t().contiguous(), "g_idx": (torch.arange(k) // group).to(torch.int32)}


def export_int4(src: str | Path, dst: str | Path, method: str = "awq", group_size: int = 128) -> Path:
    src, dst = Path(src), Path(dst)
    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be awq or gptq, got {method!r}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not LINEAR.match(name):
            out[name] = w
            continue
        base = name.removesuffix(".weight")
        q, zeros, scales = quantize_groups(w, group_size, symmetric=method == "gptq")
        packed = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, group_size)
        out.update({f"{base}.{k}": v for k, v in packed.items()})
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": ["visual"]} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
         "damp_percent": 0.01, "true_sequential": True})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--method", choices=("awq", "gptq"), default="awq")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    print(export_int4(args.src, args.dst, args.method, args.group_size))


if __name__ == "__main__":
    main()
