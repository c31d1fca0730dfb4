"""The varlen Triton attention kernel (the CUDA path of the LM's paged attention and the vision towers) against a
float64 reference, on CUDA where there is one and in Triton's interpreter on the CPU: mixed steps (decode rows,
fresh prefills, chunks with a cached prefix), grouped-query shapes, head sizes no power of two, bf16; every output
element written; the metadata the engine builds for it and for the CPU path give the same attention."""

from __future__ import annotations

import pytest
import torch

from vlserve.engine.forward_batch import ForwardBatch, attention_metadata
from vlserve.model.accelerator import NATIVE, TRITON
from vlserve.model.kernels import triton_attention
from vlserve.model.kernels.triton_attention import varlen_attention, work_list
from vlserve.model.layers.attention import paged_attention

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, q_lens, kv_lens, key_rows, causal, scale):
    """float64 attention, sequence by sequence: `key_rows[b]` are the rows of k/v sequence b attends over."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    start = 0
    for n, length, rows in zip(q_lens, kv_lens, key_rows):
        qs = q[start : start + n].double()
        ks = k[rows].double().repeat_interleave(group, 1)
        vs = v[rows].double().repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->htk", qs, ks) * scale
        if causal:
            q_pos = torch.arange(n)[:, None] + (length - n)
            scores = scores.masked_fill(~(torch.arange(length)[None, :] <= q_pos)[None], float("-inf"))
        out[start : start + n] = torch.einsum("htk,khd->thd", scores.softmax(-1), vs)
        start += n
    return out


def paged_case(heads, kv_heads, head_dim, q_lens, kv_lens, block_size, dtype, seed=0):
    """A KV cache of shuffled blocks holding each sequence's context, and the queries of its last q_len tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks_each) + 3
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(kv_lens), max(blocks_each), dtype=torch.long)
    used = 0
    for b, nb in enumerate(blocks_each):
        table[b, :nb] = order[used : used + nb]
        used += nb
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    rows = [table[b][torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
            for b, n in enumerate(kv_lens)]
    return q, k, v, table, rows


MIXED = ([1, 1, 7, 1, 20, 33], [5, 40, 7, 17, 33, 60])  # decode rows, a fresh prefill, chunks after a prefix


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 80), (2, 2, 32), (6, 2, 24), (16, 2, 64)])
def test_paged_causal_matches_reference(heads, kv_heads, head_dim):
    q_lens, kv_lens = MIXED
    q, k, v, table, rows = paged_case(heads, kv_heads, head_dim, q_lens, kv_lens, 4, torch.float32)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    out = torch.full_like(q, float("nan"))  # every element must be written
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got = varlen_attention(dev(q), dev(k), dev(v), dev(starts), max(q_lens), head_dim**-0.5, True,
                           dev(torch.tensor(kv_lens)), dev(table), 4, out=dev(out)).cpu()
    want = reference(q, k, v, q_lens, kv_lens, rows, True, head_dim**-0.5)
    assert not got.isnan().any()
    assert (got.double() - want).abs().max() < 1e-5


def test_decode_only_step_and_bf16():
    q_lens, kv_lens = [1] * 5, [3, 16, 17, 1, 50]
    q, k, v, table, rows = paged_case(8, 2, 64, q_lens, kv_lens, 16, torch.bfloat16, seed=1)
    starts = torch.arange(6)
    got = varlen_attention(*(t.to(DEVICE) for t in (q, k, v, starts)), 1, 0.125, True,
                           torch.tensor(kv_lens, device=DEVICE), table.to(DEVICE), 16).cpu()
    want = reference(q, k, v, q_lens, kv_lens, rows, True, 0.125)
    err = (got.double() - want).norm() / want.norm()
    assert got.dtype == torch.bfloat16 and err < 1e-2  # bf16 probabilities: within bf16 rounding


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_vision_sequences_attend_only_inside_themselves(dtype, tolerance):
    """Not paged, not causal: the rows of q/k/v themselves, split by cu_seqlens (frames, windows)."""
    lengths = [16, 4, 36, 1, 64]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), 5, 80, generator=g).to(dtype) for _ in range(3))
    starts = torch.tensor([0, *lengths]).cumsum(0)
    got = varlen_attention(*(t.to(DEVICE) for t in (q, k, v, starts)), max(lengths), 80**-0.5, False).cpu()
    rows = [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths)]
    want = reference(q, k, v, lengths, lengths, rows, False, 80**-0.5)
    assert (got.double() - want).norm() / want.norm() < tolerance


def test_strided_inputs_and_empty_sequences():
    """q/k/v as views of one fused projection (the layers' layout), and sequences with no tokens (a captured
    graph's unused entries) that must neither fail nor write."""
    lengths = [3, 0, 5, 0]
    qkv = torch.randn(8, 3 * 4, 16)
    q, k, v = qkv.split([4, 4, 4], dim=1)
    starts = torch.tensor([0, *lengths]).cumsum(0)
    got = varlen_attention(*(t.to(DEVICE) for t in (q, k, v, starts)), 5, 0.25, False).cpu()
    rows = [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths)]
    want = reference(q, k, v, lengths, lengths, rows, False, 0.25)
    assert (got.double() - want).abs().max() < 1e-5


def test_work_list_names_every_query_block_once():
    starts = torch.tensor([0, 1, 2, 70, 70, 71])  # lengths 1, 1, 68, 0, 1
    seq, block = work_list(starts, 16, 71)
    pairs = [(s, b) for s, b in zip(seq.tolist(), block.tolist()) if s < 5]
    assert pairs == [(0, 0), (1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (4, 0)]
    assert len(seq) == -(-71 // 16) + 5 and set(seq.tolist()[len(pairs):]) == {5}  # the rest: spare programs


@pytest.mark.parametrize("cpu_kernels", ["1", "0"], ids=["cpu-kernels", "torch-fallback"])
def test_engine_metadata_gives_both_paths_the_same_attention(monkeypatch, cpu_kernels):
    """One step's ForwardBatch (two decode rows, a fresh prompt, a chunk after a cached prefix) through
    attention_metadata for the Triton path and for the CPU path (its compiled kernels, or torch's SDPA where there
    are none): the same outputs and the same cache writes; the Triton path's layers share one work list."""
    monkeypatch.setenv("VLSERVE_CPU_KERNELS", cpu_kernels)
    bs, heads, kv_heads, hd = 4, 4, 2, 32
    table = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 6, 0, 0], [9, 4, 8, 10]])
    ctx = torch.tensor([10, 3, 6, 15])  # decode, decode, fresh prefill of 6, chunk of 5 after 10 cached
    q_lens = [1, 1, 6, 5]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(q_lens)])
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx.tolist(), q_lens)])
    slots = table[seq, pos // bs] * bs + pos % bs
    batch = ForwardBatch(torch.zeros(13, dtype=torch.long), torch.zeros(3, 13, dtype=torch.long), slots, 2, table,
                         ctx, [(2, 6, 6), (8, 5, 15)], None, None, torch.tensor([12]))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(13, heads, hd, generator=g)
    k, v = torch.randn(13, kv_heads, hd, generator=g), torch.randn(13, kv_heads, hd, generator=g)
    cache = torch.randn(2, 12 * bs, kv_heads, hd, generator=g)
    outs, caches = [], []
    for backend, device in ((NATIVE, "cpu"), (TRITON, DEVICE)):
        c = cache.clone().to(device)
        meta = attention_metadata(batch, bs, torch.device(device), backend)
        for _ in range(2):  # two layers of one step
            out = paged_attention(q.to(device), k.to(device), v.to(device), c, meta, hd**-0.5).cpu()
        outs.append(out)
        caches.append(c.cpu())
        if backend == TRITON:
            assert len(meta.varlen.work) == 1  # built by the first layer, reused by the second
    assert torch.equal(caches[0], caches[1])
    assert (outs[0] - outs[1]).abs().max() < 1e-5
