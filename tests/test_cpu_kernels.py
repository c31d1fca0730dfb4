"""vlserve's compiled CPU kernels against plain torch, for every ISA copy this CPU can run (generic, AVX2,
AVX-512), and the torch fallbacks that take over where a kernel does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlserve.model.kernels import cpu_kernels
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.layers.quantized_linear import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    deinterleave4,
    interleave4,
    pack_int4,
    unpack_int4,
)
from vlserve.model.layers.rotary import apply_rotary, rotate_half

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler here: the torch fallbacks run instead")
ISA_NAMES = {0: "generic", 1: "avx2", 2: "avx512"}
# Every copy is listed; the ones this CPU cannot run skip with the reason (an AVX2-only CI machine still runs the
# generic and AVX2 copies, an AVX-512 one all three).
ISAS = [pytest.param(isa, id=name, marks=pytest.mark.skipif(
            kernels is not None and isa > kernels.cpu_isa(), reason=f"this CPU cannot run the {name} copy"))
        for isa, name in ISA_NAMES.items()]
DTYPES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative tolerance: bf16 output rounding


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype):
    scale = want.abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= DTYPES[dtype] * scale


def test_layouts_round_trip():
    q = torch.randint(0, 16, (8, 64))
    assert torch.equal(unpack_int4(pack_int4(q)).long(), q)
    t = torch.randint(-128, 127, (12, 48), dtype=torch.int8)
    assert torch.equal(deinterleave4(interleave4(t)), t)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
def test_int8_linear(isa, dtype, rows):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, 40, bias=True)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 96).to(dtype)
    got = kernels.int8_linear(x, q.qweight, q.scale, isa)
    assert got.dtype == dtype and got.shape == (rows, 40)
    _close(got, x.float() @ q.dequantized_weight().t(), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows, group", [(1, 32), (2, 64), (7, 32), (9, 128)])
def test_int4_linear(isa, dtype, rows, group):
    torch.manual_seed(rows)
    n, k = 24, 256
    lin = Int4Linear(k, n, False, group, torch.float32)
    lin.packed.copy_(pack_int4(torch.randint(0, 16, (n, k))))
    lin.scales.copy_(torch.rand(n, k // group) * 0.1)
    lin.zeros.copy_(torch.randint(0, 16, (n, k // group)).float())
    x = torch.randn(rows, k).to(dtype)
    got = kernels.int4_linear(x, lin.packed, lin.scales, lin.zeros, group, isa)
    _close(got, x.float() @ lin.dequantized_weight().t(), dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantized_linears_agree_across_the_kernel_and_dense_paths(dtype, weight_only_int8):
    """Few rows go to the kernel, many to a dense GEMM on the expanded weight: the same function either way (int8
    activations past the kernel's rows are tests/test_int8_gemm.py's)."""
    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(64, 32, bias=True).to(dtype))
    x = torch.randn(KERNEL_MAX_ROWS + 8, 64).to(dtype)
    with torch.inference_mode():
        many = q(x)
        few = torch.cat([q(x[i : i + 4]) for i in range(0, x.shape[0], 4)])
    _close(few, many, dtype)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_expand(isa):
    """Rows [n0, n1) of an interleaved int8 weight, scaled, as fp32: exactly the dequantized weight's rows."""
    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(48, 20))
    want = q.dequantized_weight()
    for n0, n1 in ((0, 20), (4, 12), (16, 16)):
        assert torch.equal(kernels.int8_expand(q.qweight, q.scale, n0, n1, isa), want[n0:n1])
    with pytest.raises(RuntimeError, match="rows"):
        kernels.int8_expand(q.qweight, q.scale, 2, 8, isa)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_int8_dense_path_expands_a_large_weight_in_pieces(monkeypatch, path, weight_only_int8):
    """Past the kernel's rows a weight is expanded piece by piece (a cache-sized piece with the kernels, pieces of
    an LM head's vocabulary without them): the same result as the whole dequantized weight."""
    from vlserve.model.layers import quantized_linear

    monkeypatch.setattr(quantized_linear, "EXPAND_BYTES", 8 * 64 * 4)  # 8 rows of 64 inputs
    monkeypatch.setattr(quantized_linear, "DENSE_CHUNK_ROWS", 24)
    if path == "torch":
        monkeypatch.setattr(quantized_linear.cpu_kernels, "for_tensor", lambda x, dtypes=None: None)
    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(64, 100, bias=True))
    x = torch.randn(KERNEL_MAX_ROWS + 8, 64)
    with torch.inference_mode():
        torch.testing.assert_close(q(x), x @ q.dequantized_weight().t() + q.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads, d", [(6, 32), (10, 64), (2, 16)])  # GQA groups of 3, 5 (4 + 1), 1
def test_paged_decode_attention(isa, dtype, heads, d):
    """Scattered blocks, ragged contexts (one of a single token), GQA."""
    torch.manual_seed(0)
    bs, kvh, blocks = 4, 2, 40
    k_cache = torch.randn(blocks * bs, kvh, d).to(dtype)
    v_cache = torch.randn(blocks * bs, kvh, d).to(dtype)
    lens = torch.tensor([1, 9, 23])
    table = torch.stack([torch.randperm(blocks)[:6] for _ in lens])
    q = torch.randn(len(lens), heads, d).to(dtype)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, bs, d**-0.5, isa)
    for b, n in enumerate(lens.tolist()):
        slots = (table[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs)
        k = k_cache[slots].float().repeat_interleave(heads // kvh, 1).transpose(0, 1)  # [heads, n, d]
        v = v_cache[slots].float().repeat_interleave(heads // kvh, 1).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=d**-0.5)[:, 0]
        _close(got[b], want, dtype)


def test_paged_attention_uses_the_kernel_and_matches_the_gather_path(monkeypatch):
    """Through paged_attention: the kernel path and the SDPA gather path give the same decode outputs."""
    torch.manual_seed(1)
    bs, kvh, heads, d = 4, 2, 4, 16
    kv = torch.randn(2, 32 * bs, kvh, d)
    table = torch.tensor([[3, 7, 1], [5, 0, 0]])
    lens = torch.tensor([10, 3])
    mask = (torch.arange(3 * bs)[None] < lens[:, None])[:, None, None, :]
    last = lens - 1
    slots = table[torch.arange(2), last // bs] * bs + last % bs
    q, k, v = torch.randn(2, heads, d), torch.randn(2, kvh, d), torch.randn(2, kvh, d)

    def run(with_lens: bool):
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, block_size=bs,
                                 decode_blocks=table.view(-1), decode_mask=mask,
                                 decode_context_lens=lens if with_lens else None)
        return paged_attention(q, k, v, kv.clone(), meta, d**-0.5)

    class Spy:
        calls = 0

        def paged_decode_attention(self, *args):
            Spy.calls += 1
            return kernels.paged_decode_attention(*args)

    monkeypatch.setattr(cpu_kernels, "load", lambda: Spy())
    with_kernel = run(True)
    assert Spy.calls == 1
    _close(with_kernel, run(False), torch.float32)  # no context lengths: the gather + SDPA path
    assert Spy.calls == 1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [64, 80, 1024, 40])
def test_rms_norm_kernel(isa, width):
    """bf16: bit-identical to the torch formula; fp32: within an ulp or so (another summation order)."""
    torch.manual_seed(width)
    for dtype in DTYPES:
        norm = RMSNorm(width).to(dtype)
        norm.weight.data = torch.randn(width).to(dtype)
        x = torch.randn(7, width).to(dtype)
        got = kernels.rms_norm(x, norm.weight, norm.eps, isa)
        with torch.inference_mode():
            x32 = x.float()
            want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_rotary_kernel_is_bit_identical(isa, head_dim):
    """LM style (cos/sin in the dtype, rounded after each op) and vision style (fp32 math, rounded once)."""
    torch.manual_seed(head_dim)
    t, heads_total, heads = 5, 6, 4
    for dtype in DTYPES:
        qkv = torch.randn(t, heads_total, head_dim).to(dtype)
        cos, sin = torch.randn(t, head_dim).to(dtype), torch.randn(t, head_dim).to(dtype)
        x = qkv.clone()
        kernels.rotary_(x, cos, sin, heads, isa)
        assert torch.equal(x[:, :heads], apply_rotary(qkv[:, :heads], cos, sin))
        assert torch.equal(x[:, heads:], qkv[:, heads:])  # the other heads (v) untouched
        cos32, sin32 = torch.randn(t, head_dim), torch.randn(t, head_dim)
        x = qkv.clone()
        kernels.rotary_(x, cos32, sin32, heads, isa)
        q = qkv[:, :heads].float()
        want = (q * cos32[:, None] + rotate_half(q) * sin32[:, None]).to(dtype)
        assert torch.equal(x[:, :heads], want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [4096, 64, 40, 13])
def test_silu_mul_kernel(isa, width):
    """SwiGLU's silu(gate) * up: bf16 bit-identical to torch's ops, fp32 within an ulp or two (another exp)."""
    torch.manual_seed(width)
    for dtype in DTYPES:
        x = (torch.randn(9, 2 * width) * 4).to(dtype)
        x[0, : min(width, 8)] = torch.tensor([-88.5, -88.7, -89.0, -100.0, 88.5, 89.0, -87.0, 100.0])[: min(width, 8)]
        gate, up = x.chunk(2, dim=-1)
        got, want = kernels.silu_mul(x, isa), F.silu(gate) * up
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gated_mlp_uses_the_silu_kernel(monkeypatch):
    from vlserve.model.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, "silu", bias=False).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)

    class Spy:
        calls = 0

        def silu_mul(self, *args):
            Spy.calls += 1
            return kernels.silu_mul(*args)

    with torch.inference_mode():
        monkeypatch.setattr(cpu_kernels, "load", lambda: Spy())
        fused = mlp(x)
        assert Spy.calls == 1
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # the torch ops instead
        assert torch.equal(fused, mlp(x))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dk,dv", [(128, 128), (16, 24), (8, 13)])
def test_gated_delta_step_kernel_updates_the_pool_in_place(isa, dk, dv):
    """Gated DeltaNet's decode step on states in the pool: the same output and states as the torch step (fp32,
    another summation order), other slots untouched, a fresh sequence starting from zero; several steps chained."""
    from vlserve.model.layers.gated_delta import _prepare, gated_delta_step

    torch.manual_seed(dk + dv)
    B, Hk, H, slots = 3, 2, 4, 6
    pool = torch.randn(slots, H, dk, dv) * 0.3
    slot_ids, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    want_pool = pool.clone()
    for _ in range(3):
        q, k = torch.randn(B, Hk, dk), torch.randn(B, Hk, dk)
        v, g, beta = torch.randn(B, H, dv), -torch.rand(B, H), torch.rand(B, H)
        start = torch.where(~fresh[:, None, None, None], want_pool[slot_ids], 0)
        want, state = gated_delta_step(q, k, v, g, beta, start)
        want_pool[slot_ids] = state
        pq, pk, pv, pg, pb = _prepare(q, k, v, g, beta)
        got = kernels.gated_delta_step(pool, slot_ids, fresh, pq.contiguous(), pk.contiguous(), pv, pg, pb, isa)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(pool, want_pool, rtol=1e-5, atol=1e-5)
        fresh = torch.zeros(B, dtype=torch.bool)
    assert torch.equal(pool[[1, 3, 5]], want_pool[[1, 3, 5]])  # slots nobody used
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.gated_delta_step(pool, torch.tensor([9, 0, 1]), fresh, pq.contiguous(), pk.contiguous(), pv, pg,
                                 pb, isa)


def test_the_decode_step_in_the_pool_takes_the_kernel_or_torch(monkeypatch):
    from vlserve.model.layers import gated_delta

    torch.manual_seed(1)
    pool = torch.randn(5, 4, 16, 16) * 0.3
    args = (torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.randn(2, 4, 16), -torch.rand(2, 4), torch.rand(2, 4))
    slots, fresh = torch.tensor([3, 1]), torch.tensor([False, True])
    fallback_pool = pool.clone()
    got = gated_delta.gated_delta_step_in_pool(*args, pool, slots, fresh)
    monkeypatch.setattr(cpu_kernels, "for_tensor", lambda *a, **k: None)
    want = gated_delta.gated_delta_step_in_pool(*args, fallback_pool, slots, fresh)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(pool, fallback_pool, atol=1e-5)
