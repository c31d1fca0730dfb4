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
import math
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vlserve.core.errors import InvalidInputError

LINEAR = re.compile(r"^(model\.language_model\.|model\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                    r"\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output channel stored in nibble i of an AutoAWQ word
METHODS = ("awq", "gptq")
GROUP_MULTIPLE = 32  # vlserve's loader and Int4Linear take group sizes that are multiples of this


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


def _source_tensors(src: Path) -> dict[str, torch.Tensor]:
    if not src.is_dir():
        raise InvalidInputError(f"{src} is not a checkpoint folder")
    if not (src / "config.json").is_file():
        raise InvalidInputError(f"{src} has no config.json: not a Hugging Face checkpoint folder")
    qc = json.loads((src / "config.json").read_text()).get("quantization_config")
    if qc:
        raise InvalidInputError(f"{src} is already quantized ({qc.get('quant_method', '?')}); export from the "
                                "full-precision checkpoint")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InvalidInputError(f"{src} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _layer(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def fitting_group_sizes(in_features: list[int]) -> list[int]:
    """The group sizes vlserve loads (multiples of GROUP_MULTIPLE) that divide every one of these input sizes."""
    common = math.gcd(*in_features)
    return [g for g in range(GROUP_MULTIPLE, common + 1, GROUP_MULTIPLE) if common % g == 0]


def check_shapes(shapes: dict[str, tuple[int, int]], group_size: int) -> None:
    """Every linear to quantize ([out, in] by name) must fit the group size and the 8-a-word packing; raises
    InvalidInputError naming the first that does not and a --group-size that fits, when there is one."""
    if not shapes:
        raise InvalidInputError("found none of the decoder layers' linears to quantize (names like "
                                "model.layers.0.self_attn.q_proj.weight); is this a Qwen-VL checkpoint?")
    for name, (n, _) in shapes.items():
        if n % 8:  # AWQ packs 8 output channels a word, and both formats pack their zeros that way
            raise InvalidInputError(f"{_layer(name)} has {n} output channels; 4-bit packing needs a multiple of 8, "
                                    "so no --group-size can make this checkpoint exportable")
    sizes = sorted({k for _, k in shapes.values()})
    fits = fitting_group_sizes(sizes)
    listed = ", ".join(map(str, sizes))
    if not fits:  # whatever was asked for: no group size can help
        name, k = next((name, k) for name, (_, k) in shapes.items() if k % GROUP_MULTIPLE)  # (there is one)
        raise InvalidInputError(f"no --group-size fits this checkpoint: vlserve needs a multiple of {GROUP_MULTIPLE} "
                                f"that divides every quantized linear's input size, and {_layer(name)} takes {k} "
                                f"(input sizes here: {listed})")
    pick = max([g for g in fits if g <= max(group_size, GROUP_MULTIPLE)] or [min(fits)])
    hint = f"use --group-size {pick}, which divides all of this checkpoint's input sizes ({listed})"
    if group_size <= 0 or group_size % GROUP_MULTIPLE:
        raise InvalidInputError(f"--group-size {group_size}: vlserve loads 4-bit checkpoints whose group size is a "
                                f"positive multiple of {GROUP_MULTIPLE}; {hint}")
    for name, (_, k) in shapes.items():
        if k % group_size:
            raise InvalidInputError(f"--group-size {group_size} does not divide the input size {k} of {_layer(name)}; "
                                    f"{hint}")


def export_int4(src: str | Path, dst: str | Path, method: str = "awq", group_size: int = 128) -> Path:
    """Writes the 4-bit copy of `src` to `dst`; user mistakes (a missing folder, a group size that does not fit
    the model) raise InvalidInputError before anything is written."""
    src, dst = Path(src), Path(dst)
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    tensors = _source_tensors(src)
    check_shapes({name: tuple(w.shape) for name, w in tensors.items() if LINEAR.match(name)}, group_size)
    if dst.resolve() == src.resolve():
        raise InvalidInputError(f"the output folder must not be the source folder ({src})")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlserve.tools.int4_export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="full-precision checkpoint folder")
    ap.add_argument("dst", help="output folder (created if missing)")
    ap.add_argument("--method", choices=METHODS, default="awq", help="layout to write (default: awq)")
    ap.add_argument("--group-size", type=int, default=128,
                    help=f"input channels per scale and zero, a multiple of {GROUP_MULTIPLE} that divides every "
                         "quantized linear's input size (default: 128)")
    args = ap.parse_args(argv)
    try:
        print(export_int4(args.src, args.dst, args.method, args.group_size))
    except InvalidInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
