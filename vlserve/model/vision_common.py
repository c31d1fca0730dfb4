"""Pieces shared by the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers.

Many images (or windows of one image) go through the ViT in one call as a flat `[N, width]` token list;
`cu_seqlens` marks where each sequence starts so no token attends across an image (or window) boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.model.accelerator import TRITON, attention_backend, to_device
from vlserve.model.config_types import VisionConfig
from vlserve.model.hardware import detect
from vlserve.model.kernels import cpu_kernels, triton_kernels
from vlserve.model.layers.parallel import column_linear, current_tp, even_split, head_split, row_linear
from vlserve.model.layers.rotary import rotate_heads_

GEMM_ATTENTION_SCORES = 1 << 22  # score elements per block of queries: a few MB, so the block stays in cache


class PatchEmbed(nn.Module):
    """The reference is a Conv3d whose kernel equals its stride, i.e. a linear map of each flattened patch."""

    def __init__(self, cfg: VisionConfig, bias: bool = False):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.width, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


def merge_order_hw(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row/column of every patch, listed in the order the processor emits them (merge-window major)."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = cols.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    return rows, cols


class VisionRotary(nn.Module):
    """2D RoPE: the first half of the rotated dims follows the patch row, the second half its column."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        dim = cfg.head_dim // 2
        # fp32 plain attribute (not a buffer) so weight dtype casts and meta-device construction leave it alone
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        self.merge = cfg.spatial_merge_size

    def forward(self, grids: list[tuple[int, int, int]], device: torch.device):
        """`grids`: each item's (t, h, w) patch grid (its `layout`), in the order its patches come."""
        rows, cols = zip(*(merge_order_hw(t, h, w, self.merge) for t, h, w in grids))
        rows, cols = torch.cat(rows), torch.cat(cols)
        freqs = to_device(torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1), device)
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim], fp32
        return emb.cos(), emb.sin()


@dataclass
class VarlenPlan:
    """How to run attention over sequences of given lengths; built once per forward, used by every block.

    On CUDA (the Triton attention backend) one kernel launch covers every sequence: `cu_seqlens` holds where each
    starts. On CPU, uniform lengths run as one batch, nearly uniform ones as a padded batch, others one by one."""

    lengths: list[int]
    gather: torch.Tensor | None = None  # [n, max_len] token rows, for the padded batch
    mask: torch.Tensor | None = None  # [n, 1, 1, max_len]
    valid: torch.Tensor | None = None  # [n, max_len] which padded rows are real
    cu_seqlens: torch.Tensor | None = None  # [n + 1] int64 on the device: the varlen kernel's sequence starts
    max_len: int = 0  # the longest sequence (sizes the varlen kernel's tiles)
    work: dict = field(default_factory=dict)  # the varlen kernel's work lists, built by the first block

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1


def plan_varlen(lengths: list[int], device: torch.device, max_waste: float = 0.25) -> VarlenPlan:
    plan = VarlenPlan(lengths)
    if attention_backend(device) == TRITON:
        plan.cu_seqlens = to_device(torch.tensor([0, *lengths], dtype=torch.long).cumsum(0), device)
        plan.max_len = max(lengths, default=0)
        return plan
    if plan.uniform:
        return plan
    longest, total = max(lengths), sum(lengths)
    if longest * len(lengths) > (1 + max_waste) * total:
        return plan  # padding would waste too much compute: loop over sequences instead
    lens = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lens, 0) - lens
    offs = torch.arange(longest, device=device)
    plan.valid = offs.unsqueeze(0) < lens.unsqueeze(1)
    plan.gather = torch.where(plan.valid, starts.unsqueeze(1) + offs, 0)
    plan.mask = plan.valid[:, None, None, :]
    return plan


def attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Full attention, [B, heads, L, d] -> [B, heads, L, d]; `mask` [B, 1, 1, S] (True: attend). Used where
    vlserve's kernel is not (see `varlen_attention`; on AVX-512 the kernel computes fp32 scores in every dtype).

    On CPUs that multiply bf16 in hardware, bf16 attention runs as two GEMMs per block of queries: ~350
    GFLOP/s on AVX-512-BF16, against ~160 for torch's CPU flash kernel, whose inner loop is not a GEMM. The
    scores are rounded to bf16 as in transformers' eager attention. Elsewhere (fp32, whose parity with
    transformers is token-exact; AVX2; CUDA) torch's SDPA.
    """
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or not detect().native_bf16:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    batch, heads, length, dim = q.shape
    rows = max(32, min(length, GEMM_ATTENTION_SCORES // (batch * heads * k.shape[-2])))
    # Head-major copies (the callers' views are token-major): strided GEMM operands cost half the speed.
    q, v = q.contiguous(), v.contiguous()
    keys_t = k.transpose(-1, -2).contiguous()
    out = torch.empty_like(q)
    for start in range(0, length, rows):
        scores = torch.matmul(q[:, :, start : start + rows] * dim**-0.5, keys_t)  # [B, heads, rows, S]
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        out[:, :, start : start + rows] = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out


def _kernels(q: torch.Tensor):
    """vlserve's CPU attention kernel where it beats the paths below: AVX-512 (with bf16 dot products for bf16,
    ~1.2x the GEMM attention at 1024 patches and fp32 scores; fp32 FMAs otherwise, ~1.5x SDPA)."""
    if q.shape[-1] % 16 or cpu_kernels.isa_cap() < 2:
        return None
    return cpu_kernels.for_tensor(q)


def varlen_attention(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    """q/k/v: [N, heads, head_dim] -> [N, heads, head_dim], attention only within each sequence."""
    n_tok, heads, hd = q.shape
    if plan.cu_seqlens is not None:
        return triton_kernels().varlen_attention(q, k, v, plan.cu_seqlens, plan.max_len, hd**-0.5, causal=False,
                                                 out=q.new_empty(n_tok, heads, hd), work_cache=plan.work)
    kernels = _kernels(q)
    if kernels is not None:  # one call per sequence: no padding, no mask
        return torch.cat([kernels.prefill_attention(qs, ks, vs, False, hd**-0.5, cpu_kernels.isa_cap())
                          for qs, ks, vs in zip(*(x.split(plan.lengths) for x in (q, k, v)))])
    if plan.uniform:
        n, length = len(plan.lengths), plan.lengths[0]
        qb, kb, vb = (x.view(n, length, heads, hd).transpose(1, 2) for x in (q, k, v))
        return attention(qb, kb, vb).transpose(1, 2).reshape(n_tok, heads, hd)
    if plan.gather is not None:
        qb, kb, vb = (x[plan.gather].transpose(1, 2) for x in (q, k, v))  # [n, heads, max_len, hd]
        out = attention(qb, kb, vb, plan.mask)
        return out.transpose(1, 2)[plan.valid]
    outs = []
    for qs, ks, vs in zip(*(x.split(plan.lengths) for x in (q, k, v))):
        # 4D [1, heads, len, hd]: torch's CPU flash kernel takes it; 3D inputs fall back to a ~2.5x slower path
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))
        outs.append(attention(qs, ks, vs).squeeze(0).transpose(0, 1))
    return torch.cat(outs)


class VisionAttention(nn.Module):
    """Tensor parallel like the LM's: whole heads per rank, proj's partial sums reduced."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.tp = tp = current_tp()
        heads = head_split(cfg.num_heads, cfg.head_dim, tp, "vision attention heads")
        self.num_heads, self.head_dim = heads.size // cfg.head_dim, cfg.head_dim
        self.q_size = self.kv_size = heads.size  # rows of each piece of qkv (a checkpoint may store them apart)
        self.qkv = column_linear(cfg.width, {"q": heads, "k": heads, "v": heads}, bias=True)
        self.proj = row_linear(heads, cfg.width, True, tp)

    def forward(self, x, cos, sin, plan: VarlenPlan) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3 * self.num_heads, self.head_dim)
        # rotary in fp32 like the reference (cos/sin are fp32), on q and k together, in place
        q, k, v = rotate_heads_(qkv, cos, sin, 2 * self.num_heads).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return self.tp.all_reduce(self.proj(varlen_attention(q, k, v, plan).reshape(n, -1)))


class PatchMerger(nn.Module):
    """Concatenates each merge x merge window of patches and projects it to the LM width."""

    def __init__(self, cfg: VisionConfig, norm: nn.Module):
        super().__init__()
        self.ln_q = norm
        self.hidden = cfg.width * cfg.spatial_merge_size**2
        self.tp = tp = current_tp()
        cols = even_split(self.hidden, tp, "vision merger width")
        self.mlp = nn.Sequential(column_linear(self.hidden, {"": cols}, True), nn.GELU(),
                                 row_linear(cols, cfg.out_dim, True, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.mlp(self.ln_q(x).view(-1, self.hidden)))


@dataclass
class VisionPass:
    """A vision tower's call split where graphs need it: `prepare` (patch embedding and what depends on the
    pictures' grids: rotary angles, sequence lengths, a reordering) runs op by op; `body(x, cos, sin, plans)` (the
    blocks and mergers) has shapes fixed by the token count alone, so it can be captured per token count.
    `finish` turns body's merged rows back into the processor's order."""

    x: torch.Tensor  # [N, width] embedded patches
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor
    lengths: dict[str, list[int]]  # attention sequences by plan name ("full", "window")
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None

    def plans(self) -> dict[str, VarlenPlan]:
        return {name: plan_varlen(lengths, self.x.device) for name, lengths in self.lengths.items()}

    def run(self, body) -> torch.Tensor:
        out = body(self.x, self.cos, self.sin, self.plans())
        return out if self.finish is None else self.finish(out)


def cu_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """Full attention runs per frame: each (t, h, w) item contributes t sequences of h*w patches."""
    return [h * w for t, h, w in grids for _ in range(t)]
