"""vlserve's flash-style CPU prefill attention kernel against torch's SDPA, and through paged_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_cpu_kernels import DTYPES, ISAS, _close
from tests.test_cpu_kernels import kernels as built
from vlserve.model.kernels import cpu_kernels
from vlserve.model.layers import attention
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span, paged_attention

kernels = built
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler here: the torch fallbacks run instead")
# the copies of test_cpu_kernels, and the one with bf16 dot products (it takes bf16 inputs; fp32 ones run the
# AVX-512 copy under it)
ISAS_DP = ISAS + [pytest.param(3, id="avx512_bf16", marks=pytest.mark.skipif(
    kernels is not None and kernels.cpu_isa() < 3, reason="this CPU has no AVX-512-BF16"))]


def _reference(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """fp32 SDPA; causal with the first S - L keys a cached prefix every query sees."""
    L, S = q.shape[0], k.shape[0]
    mask = torch.arange(S)[None] <= torch.arange(L)[:, None] + (S - L) if causal else None
    qs, ks, vs = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def _fused(L: int, S: int, heads: int, kv_heads: int, d: int, dtype, spread: float):
    """q, k, v as views of one fused projection (rows strided, as the models hand them over); keys before the
    last L are a separate prefix, so k/v are then contiguous copies with another row stride than q."""
    qkv = (torch.randn(L, heads + 2 * kv_heads, d) * spread).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    if S > L:
        k = torch.cat([(torch.randn(S - L, kv_heads, d) * spread).to(dtype), k])
        v = torch.cat([torch.randn(S - L, kv_heads, d).to(dtype), v])
    return q, k, v


@pytest.mark.parametrize("isa", ISAS_DP)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("L, S, heads, kv_heads, d, causal", [
    (37, 37, 8, 2, 128, True),  # a prompt alone, GQA 4:1
    (64, 100, 4, 2, 16, True),  # a chunk after a prefix: early rows see none of the last key block
    (70, 200, 10, 2, 64, True),  # GQA 5:1 (12 positions x 5 heads per unit), prefix longer than a key block
    (1, 9, 4, 1, 32, True),  # one new token after eight cached ones
    (3, 67, 2, 2, 16, True),  # an odd number of keys: the last bf16 pair is half padding
    (150, 150, 10, 10, 64, False),  # vision: no mask, one head per group
    (33, 33, 16, 16, 80, False),  # Qwen2-VL's ViT head size
    (20, 20, 4, 4, 72, False),  # Qwen3-VL's (not a multiple of 16: a narrower copy runs)
])
def test_matches_sdpa(isa, dtype, L, S, heads, kv_heads, d, causal):
    torch.manual_seed(L + S)
    q, k, v = _fused(L, S, heads, kv_heads, d, dtype, spread=3.0)  # peaky softmax: the running max matters
    got = kernels.prefill_attention(q, k, v, causal, d**-0.5, isa)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, _reference(q, k, v, causal, d**-0.5), dtype)


def test_refuses_what_it_cannot_compute():
    q, k, v = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="all fp32 or all bf16"):
        kernels.prefill_attention(q, k.bfloat16(), v, True, 1.0, 2)
    with pytest.raises(RuntimeError, match="needs its own keys"):
        kernels.prefill_attention(q, k[:3], v[:3], True, 1.0, 2)
    with pytest.raises(RuntimeError, match="heads"):  # 3 query heads cannot share 2 key/value heads
        kernels.prefill_attention(torch.randn(4, 3, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), True, 1.0, 2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_paged_attention_prefills_match_the_sdpa_path(monkeypatch, dtype):
    """A step with two decode rows, a fresh prompt and a chunk after a cached prefix: the kernel path equals the
    SDPA path it replaces, and the kernel really ran (once per prefill chunk)."""
    torch.manual_seed(3)
    bs, kvh, heads, d, blocks = 4, 2, 4, 16, 64
    kv = torch.randn(2, blocks * bs, kvh, d).to(dtype)
    decode_table = torch.tensor([[3, 7, 1], [5, 0, 0]])
    decode_lens = torch.tensor([10, 3])
    last = decode_lens - 1
    decode_slots = decode_table[torch.arange(2), last // bs] * bs + last % bs
    fresh_slots = torch.arange(40, 40 + 9)  # a 9-token prompt, nothing cached
    prefix = torch.arange(100, 100 + 12)  # a chunk of 6 after 12 cached tokens
    chunk_slots = torch.arange(112, 118)
    slots = torch.cat([decode_slots, fresh_slots, chunk_slots])
    T = len(slots)
    q, k, v = (torch.randn(T, n, d).to(dtype) for n in (heads, kvh, kvh))

    def run():
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, block_size=bs,
                                 decode_blocks=decode_table.view(-1), decode_context_lens=decode_lens,
                                 decode_mask=(torch.arange(3 * bs)[None] < decode_lens[:, None])[:, None, None, :])
        meta.prefills = [build_prefill_span(2, 9, 9, None),
                         build_prefill_span(11, 6, 18, torch.cat([prefix, chunk_slots]))]
        return paged_attention(q, k, v, kv.clone(), meta, d**-0.5)

    class Spy:
        calls = 0

        def __getattr__(self, name):
            return getattr(kernels, name)

        def prefill_attention(self, *args):
            Spy.calls += 1
            return kernels.prefill_attention(*args)

    monkeypatch.setattr(cpu_kernels, "load", lambda: Spy())
    with_kernel = run()
    assert Spy.calls == 2
    monkeypatch.setattr(attention, "_prefill_kernels", lambda q, k: None)
    _close(with_kernel, run(), dtype)
    assert Spy.calls == 2


def test_groups_larger_than_a_unit_keep_sdpa():
    q, k = torch.randn(3, 65, 16), torch.randn(3, 1, 16)
    assert attention._prefill_kernels(q, k) is None
    assert attention._prefill_kernels(q[:, :64], k) is kernels


@pytest.mark.skipif(kernels is None or cpu_kernels.isa_cap() < 2,  # (after VLSERVE_CPU_ISA, as the towers ask)
                    reason="the vision towers use the kernel on AVX-512")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_vision_varlen_attention_through_the_kernel(monkeypatch, dtype):
    """Three pictures of different lengths in one call: per-picture kernel calls equal the padded fallback."""
    from vlserve.model import vision_common

    torch.manual_seed(5)
    lengths = [16, 64, 36]
    qkv = torch.randn(sum(lengths), 3, 4, 16).to(dtype)
    q, k, v = qkv.unbind(1)
    plan = vision_common.plan_varlen(lengths, torch.device("cpu"))
    assert vision_common._kernels(q) is not None
    with_kernel = vision_common.varlen_attention(q, k, v, plan)
    monkeypatch.setattr(vision_common, "_kernels", lambda q: None)
    _close(with_kernel, vision_common.varlen_attention(q, k, v, plan), dtype)
