"""What this machine can do at best, measured here and now, and what one token of a model costs: the yardsticks
every benchmark prints its figures beside."""

from __future__ import annotations

import time

import torch

from vlserve.model.hf_config import load_model_config

# Bytes one quantized weight occupies in vlserve: int8 one byte (+ an fp32 scale per row, negligible); int4 half a
# byte plus an fp32 scale and zero per group of 128. int8 quantizes the LM head too; int4 checkpoints keep theirs
# in the compute dtype.
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "awq": 0.5 + 8 / 128, "gptq": 0.5 + 8 / 128}
QUANTIZED_HEAD = ("int8",)


def head_bytes(method: str | None, compute_bytes: float) -> float:
    """Bytes of one LM-head weight under a quantization method (None: unquantized)."""
    return QUANTIZED_WEIGHT_BYTES[method] if method in QUANTIZED_HEAD else compute_bytes


def _rate(fn, seconds: float) -> float:
    """Calls per second of fn, after one warm-up call."""
    fn()
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        runs += 1
    return runs / (time.perf_counter() - t0)


def _packed(w: torch.Tensor):
    """oneDNN's prepacked form of a weight (what the engine runs), or None where oneDNN cannot pack it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 16)
    except (RuntimeError, AttributeError):
        return None


def gemm_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 2.0) -> float:
    """This CPU's sustained matrix-multiply rate in `dtype` (FLOP/s), all threads: the better of torch's matmul
    and oneDNN's prepacked linear (the faster of the two differs by dtype and CPU)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = _rate(lambda: a @ b, seconds / 2)
    packed = _packed(b)
    if packed is not None:
        best = max(best, _rate(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                               seconds / 2))
    return 2 * n**3 * best


def read_bandwidth(nbytes: int = 1 << 29, seconds: float = 2.0) -> float:
    """Memory read rate (bytes/s), all threads, over buffers far larger than any cache: the better of a sum and
    a one-row product with a prepacked fp32 weight (the streaming read a decode step does)."""
    best = nbytes * _rate(torch.ones(nbytes // 4, dtype=torch.float32).sum, seconds / 2)
    w = torch.randn(nbytes // 4 // 4096, 4096)
    packed = _packed(w)
    if packed is not None:
        x = torch.randn(1, 4096)
        best = max(best, nbytes * _rate(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                        seconds / 2))
    return best


def active_lm_params(model: str) -> int:
    """Language-model parameters one token multiplies with: all but the experts it is not routed to (and the
    embedding table, a lookup; a tied LM head still counts once)."""
    cfg = load_model_config(model).text
    h, layers = cfg.hidden_size, cfg.num_layers
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense_mlp = 3 * h * cfg.intermediate_size
    moe_mlp = (3 * h * cfg.moe.intermediate_size * cfg.moe.top_k + h * cfg.moe.num_experts) if cfg.moe else 0
    mlp = sum(moe_mlp if cfg.is_sparse_layer(i) else dense_mlp for i in range(layers))
    return layers * attn + mlp + h * cfg.vocab_size


def lm_head_params(model: str) -> int:
    cfg = load_model_config(model).text
    return cfg.hidden_size * cfg.vocab_size


def decode_bytes_per_token(model: str, bytes_per_weight: float, head_bytes_per_weight: float) -> float:
    """Weight bytes a batch-1 decode step must read: the decoder layers' linears and the LM head (KV reads of a
    short context are small beside them)."""
    head = lm_head_params(model)
    return (active_lm_params(model) - head) * bytes_per_weight + head * head_bytes_per_weight


def vision_flops_per_patch(model: str) -> float:
    """2 x the ViT's parameters touched per patch (blocks and merger; attention scores left out)."""
    v = load_model_config(model).vision
    block = 4 * v.width * v.width + (3 if v.hidden_act == "silu" else 2) * v.width * v.mlp_hidden
    merge = v.spatial_merge_size**2
    merger = (v.width * merge) ** 2 / merge + v.width * merge * v.out_dim / merge
    return 2.0 * (v.depth * block + v.patch_dim * v.width + merger)
