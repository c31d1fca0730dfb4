"""Weight quantization: which method a model runs with, and how its weights get into the quantized linears.

Methods (a registry, keyed by the name users and checkpoints give):
- `int8`: made at load time from a full-precision checkpoint: every linear of the decoder layers becomes an
  Int8Linear (symmetric, one scale per output channel). The LM head, embeddings and vision tower stay as loaded.
- `awq`, `gptq`: 4-bit checkpoints, detected from config.json's `quantization_config`. Every linear whose
  checkpoint holds a `.qweight` becomes an Int4Linear before loading; the checkpoint's packing is unpacked into
  ours on the way in (`awq_unpack`, `gptq_unpack`). Layouts are those of the released Qwen2-VL / Qwen2.5-VL AWQ
  (AutoAWQ "gemm") and GPTQ-Int4 (AutoGPTQ) repos.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.model.layers.moe import SparseMoE
from vlserve.model.layers.quantized_linear import Int4Linear, Int8Linear, pack_int4

logger = logging.getLogger("vlserve.quantization")
INT4_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
OUR_INT4_BUFFERS = {".qweight": ".packed", ".qzeros": ".zeros", ".scales": ".scales"}
AWQ_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # AutoAWQ packs output channels 0..7 of a word in order 0 2 4 6 1 3 5 7


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # a key of METHODS
    group_size: int = 0  # int4: input channels per scale/zero
    zero_offset: int = 0  # GPTQ's original format stores zero - 1

    @property
    def is_checkpoint_format(self) -> bool:
        return self.method in CHECKPOINT_METHODS


def _unpack_words(words: torch.Tensor, shifts: tuple[int, ...]) -> torch.Tensor:
    """int32 words -> a new last axis of 4-bit values, one per shift."""
    return torch.stack([(words >> s) & 15 for s in shifts], dim=-1)


def awq_unpack(kind: str, tensor: torch.Tensor, cfg: QuantizationConfig) -> torch.Tensor:
    """AutoAWQ gemm tensors -> ours. qweight [K, N/8] int32 -> packed [N, K/2]; qzeros [G, N/8] -> zeros [N, G];
    scales [G, N] -> [N, G]."""
    if kind == ".scales":
        return tensor.float().t().contiguous()
    values = _unpack_words(tensor.to(torch.int32), AWQ_SHIFTS).flatten(1)  # [rows, N]
    if kind == ".qzeros":
        return values.t().float().contiguous()
    return pack_int4(values.t().contiguous())


def gptq_unpack(kind: str, tensor: torch.Tensor, cfg: QuantizationConfig) -> torch.Tensor:
    """AutoGPTQ tensors -> ours. qweight [K/8, N] int32 (8 input channels a word) -> packed [N, K/2];
    qzeros [G, N/8] (8 output channels a word) -> zeros [N, G], + 1 in the original format; scales as AWQ."""
    if kind == ".scales":
        return tensor.float().t().contiguous()
    shifts = tuple(range(0, 32, 4))
    if kind == ".qzeros":
        zeros = _unpack_words(tensor.to(torch.int32), shifts).flatten(1) + cfg.zero_offset  # [G, N]
        return zeros.t().float().contiguous()
    values = _unpack_words(tensor.to(torch.int32), shifts)  # [K/8, N, 8]
    return pack_int4(values.permute(1, 0, 2).reshape(tensor.shape[1], -1).contiguous())


def _check_bits(qc: dict, method: str) -> int:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ModelLoadError(f"{method} checkpoint with bits={bits}: vlserve runs 4-bit {method} only")
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ModelLoadError(f"{method} checkpoint with group_size={group}: vlserve needs a positive multiple of 32 "
                             "(per-channel, group_size -1, is not supported)")
    return group


def _awq_config(qc: dict) -> QuantizationConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"AWQ checkpoint version '{version}': vlserve reads the 'gemm' packing only")
    if qc.get("zero_point", True) is not True:
        raise ModelLoadError("AWQ checkpoint without zero points: not supported")
    return QuantizationConfig("awq", _check_bits(qc, "awq"))


def _gptq_config(qc: dict) -> QuantizationConfig:
    if qc.get("desc_act"):
        raise ModelLoadError("GPTQ checkpoint with desc_act=true (act-order): not supported; use one quantized "
                             "with desc_act=false")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint_format '{fmt}': vlserve reads 'gptq' and 'gptq_v2'")
    return QuantizationConfig("gptq", _check_bits(qc, "gptq"), zero_offset=1 if fmt == "gptq" else 0)


CHECKPOINT_METHODS = {"awq": (_awq_config, awq_unpack), "gptq": (_gptq_config, gptq_unpack)}
LOAD_TIME_METHODS = ("int8",)
METHODS = (*LOAD_TIME_METHODS, *CHECKPOINT_METHODS)


def resolve_quantization(requested: str | None, checkpoint: tuple[tuple[str, object], ...]) -> QuantizationConfig | None:
    """The method to run: the checkpoint's own when it is quantized, else what was asked for (or none)."""
    qc = dict(checkpoint)
    method = str(qc["quant_method"]).lower() if qc.get("quant_method") else None
    if method is not None:
        if method not in CHECKPOINT_METHODS:
            raise ModelLoadError(f"checkpoint quantization_config quant_method '{method}' is not supported; vlserve "
                                 f"runs {', '.join(CHECKPOINT_METHODS)} checkpoints (4-bit) and int8 made at load "
                                 "time from an unquantized checkpoint")
        if requested is not None and requested != method:
            raise InvalidInputError(f"quantization '{requested}' asked for, but the checkpoint is {method}-quantized "
                                    f"(leave the option out, or pass {method})")
        return CHECKPOINT_METHODS[method][0](qc)
    if requested is None:
        return None
    if requested in CHECKPOINT_METHODS:
        raise InvalidInputError(f"quantization '{requested}' needs {_with_article(requested.upper())} checkpoint, and "
                                "this one has no quantization_config; int8 quantizes a full-precision checkpoint at "
                                "load time")
    if requested not in LOAD_TIME_METHODS:
        raise InvalidInputError(f"unknown quantization '{requested}'; choose one of {', '.join(METHODS)}")
    return QuantizationConfig(requested)


def _with_article(acronym: str) -> str:
    """"an AWQ", "a GPTQ": the article goes by how the first letter is spelled out."""
    return f"{'an' if acronym[:1] in 'AEFHILMNORSX' else 'a'} {acronym}"


# ---- applying a method to a model -------------------------------------------------------------------------
def prepare_int4(model: nn.Module, files: list[Path], cfg: QuantizationConfig, our_name) -> int:
    """Before loading (model on the meta device): every linear the checkpoint quantizes becomes an Int4Linear."""
    targets: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            named = [our_name(k) for k in f.keys() if k.endswith(".qweight")]
            targets |= {n[0].removesuffix(".qweight") for n in named if n is not None}
    if not targets:
        raise ModelLoadError(f"the config says {cfg.method}, but the checkpoint holds no '.qweight' tensors")
    modules = dict(model.named_modules())
    for name in sorted(targets):
        linear = modules.get(name)
        if linear is None:
            continue  # a part this role does not build (an encoder has no LM)
        if type(linear) is not nn.Linear:
            raise ModelLoadError(f"quantized tensors for '{name}', which is not a plain linear here (quantized MoE "
                                 "experts are not supported)")
        parent, _, child = name.rpartition(".")
        try:
            quantized = Int4Linear(linear.in_features, linear.out_features, linear.bias is not None, cfg.group_size,
                                   linear.weight.dtype, device=linear.weight.device)
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from e
        setattr(model.get_submodule(parent), child, quantized)
    return len(targets)


def checkpoint_tensor(name: str, tensor: torch.Tensor, cfg: QuantizationConfig) -> tuple[str, torch.Tensor] | None:
    """A quantized checkpoint tensor under our name and in our layout; None for the ones only checked (g_idx)."""
    kind = next(s for s in INT4_SUFFIXES if name.endswith(s))
    if kind == ".g_idx":
        group = torch.arange(tensor.numel(), device=tensor.device) // cfg.group_size
        if not torch.equal(tensor.long(), group):
            raise ModelLoadError(f"'{name}' reorders input channels (act-order); not supported")
        return None
    return name.removesuffix(kind) + OUR_INT4_BUFFERS[kind], CHECKPOINT_METHODS[cfg.method][1](kind, tensor, cfg)


def quantized_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers of the Int4Linears, which the checkpoint fills like parameters."""
    return {f"{name}.{b}": buf for name, module in model.named_modules() if isinstance(module, Int4Linear)
            for b, buf in module.named_buffers(recurse=False)}


def quantize_int8(model: nn.Module) -> int:
    """After loading: the decoder layers' linears become Int8Linear (not MoE routers, whose few outputs decide
    which experts run, nor odd shapes the kernel cannot tile, which no released model has), and so does the LM
    head (as llama.cpp's Q8_0 does: a small model's vocabulary projection is a large share of each decode step's
    bytes; a tied head gets its own int8 copy, the embedding table stays as it is); returns how many.
    MoE experts stay in the compute dtype."""
    lm = getattr(model, "language_model", None)
    if lm is None:
        return 0
    swapped = 0
    for module in list(lm.layers.modules()):
        if isinstance(module, SparseMoE):
            continue
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and Int8Linear.supports(child):
                setattr(module, name, Int8Linear.from_linear(child))
                swapped += 1
    head = getattr(model, "lm_head", False)
    if type(head) is nn.Linear and Int8Linear.supports(head):
        model.lm_head = Int8Linear.from_linear(head)
        swapped += 1
    elif head is None and Int8Linear.fits(lm.embed_tokens.weight):  # tied to the embedding table
        model.lm_head = Int8Linear.from_weight(lm.embed_tokens.weight)
        swapped += 1
    return swapped
