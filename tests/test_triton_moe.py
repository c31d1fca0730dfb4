"""The fused mixture-of-experts path (two grouped GEMM launches, vlserve/model/kernels/triton_moe.py) against the
expert loop of `Experts`, on CUDA where there is one and in Triton's interpreter on the CPU: the expert layout
(every pair once, blocks of one expert, fixed sizes), decode and prefill shapes, experts that get nothing or
everything, bf16; inside a static-shapes pass; and a tiny Qwen3-VL-MoE answering as transformers does with it."""

from __future__ import annotations

import pytest
import torch

from tests.test_parity import _check, _prompts
from tests.test_qwen3_vl import GREEDY, MAX_NEW
from tests.test_qwen3_vl import _run as run_prompts
from tests.hf_reference import prompt_references
from vlserve import LLM
from vlserve.model.kernels import FUSED_MOE_ENV, fused_moe_wanted, triton_installed
from vlserve.model.layers.moe import Experts
from vlserve.model.layers.static_shapes import static_shapes

pytestmark = pytest.mark.skipif(not triton_installed(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(tokens: int, num_experts: int, top_k: int, seed: int, only: list[int] | None = None):
    """Each token's top_k distinct experts (drawn from `only` when given) and renormalized weights."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    if only is not None:
        mask = torch.full((num_experts,), float("-inf"))
        mask[only] = 0
        logits = logits + mask
    weights, experts = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return experts.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def experts_layer(hidden: int, intermediate: int, num_experts: int, dtype=torch.float32, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    layer = Experts(hidden, intermediate, num_experts, "silu")
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.2)
        layer.down_proj.normal_(0, 0.2)
    return layer.to(DEVICE, dtype)


def test_the_layout_holds_every_pair_once_in_blocks_of_one_expert():
    from vlserve.model.kernels.triton_moe import BLOCK_M, expert_layout

    for tokens, top_k, only in [(1, 2, None), (9, 2, None), (40, 4, None), (33, 1, [3]), (5, 2, [0, 7])]:
        experts, _ = routing(tokens, 8, top_k, seed=tokens, only=only)
        pair_ids, block_experts = expert_layout(experts, 8)
        pairs = tokens * top_k
        assert pair_ids.numel() == block_experts.numel() * BLOCK_M  # sizes from the token count alone
        assert block_experts.numel() == (pairs + min(8, pairs) * (BLOCK_M - 1)) // BLOCK_M + 1
        ids, owners = pair_ids.cpu().view(-1, BLOCK_M), block_experts.cpu()
        real = ids[ids < pairs]
        assert sorted(real.tolist()) == list(range(pairs)), "each pair exactly once"
        flat = experts.cpu().reshape(-1)
        used = (owners >= 0).nonzero().flatten()
        assert used.tolist() == list(range(len(used))), "spare blocks only at the end"
        assert (ids[len(used):] == pairs).all()
        for block, expert in zip(ids[: len(used)], owners[: len(used)]):
            members = block[block < pairs]
            assert len(members) > 0 and (flat[members.long()] == expert).all(), "one expert per block"
            assert members.tolist() == sorted(members.tolist())
        assert owners[: len(used)].tolist() == sorted(owners[: len(used)].tolist())


@pytest.mark.parametrize("tokens,top_k,only", [(0, 2, None), (1, 2, None), (3, 1, None), (37, 2, None),
                                               (24, 4, [5]), (17, 2, [1, 6])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_the_expert_loop(monkeypatch, tokens, top_k, only, dtype):
    """H and I that are no multiple of the tiles; experts that get nothing, or every pair."""
    layer = experts_layer(hidden=72, intermediate=40, num_experts=8, dtype=dtype)
    experts, weights = routing(tokens, 8, top_k, seed=tokens + top_k, only=only)
    weights = weights.to(dtype)
    x = torch.randn(tokens, 72, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    with torch.no_grad():
        monkeypatch.setenv(FUSED_MOE_ENV, "0")
        want = layer(x, experts, weights)
        monkeypatch.setenv(FUSED_MOE_ENV, "1")
        assert fused_moe_wanted(x)
        got = layer(x, experts, weights)
        with static_shapes():  # a graph-captured pass takes the same path (nothing read on the host)
            static = layer(x, experts, weights)
    assert torch.equal(static, got)
    if tokens == 0:  # an empty pass gives an empty answer
        assert got.shape == want.shape == (0, 72)
        return
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:  # bf16 rounds each step's output: the fused path is as near the fp32 answer as the loop is
        monkeypatch.setenv(FUSED_MOE_ENV, "0")
        with torch.no_grad():
            exact = layer.float()(x.float(), experts, weights.float())
        loop_error, fused_error = (want.float() - exact).abs().max(), (got.float() - exact).abs().max()
        assert fused_error <= 2 * loop_error + 1e-3, (fused_error, loop_error)


def test_the_expert_loop_stays_where_asked_or_off_cuda(monkeypatch):
    x = torch.zeros(2, 4)
    monkeypatch.delenv(FUSED_MOE_ENV, raising=False)
    assert fused_moe_wanted(x) is False  # the CPU keeps its loop (oneDNN-packed experts)
    monkeypatch.setenv(FUSED_MOE_ENV, "0")
    assert fused_moe_wanted(x.to(DEVICE)) is False


def test_a_moe_model_answers_as_transformers_with_the_fused_experts(tiny_ckpt, monkeypatch):
    """Greedy, fp32, a batch of text and pictures: the same tokens as transformers' generate."""
    path, _, expected = prompt_references(tiny_ckpt, _prompts(), MAX_NEW)("qwen3_vl_moe")
    monkeypatch.setenv(FUSED_MOE_ENV, "1")
    monkeypatch.setenv("VLSERVE_PACKED_LINEAR", "0")  # packed experts keep the loop (the CPU's own fast path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    calls = []
    from vlserve.model.kernels import triton_moe_kernels

    kernels = triton_moe_kernels()
    original = kernels.fused_experts
    monkeypatch.setattr(kernels, "fused_experts", lambda *a, **k: calls.append(1) or original(*a, **k))
    _check(run_prompts(llm, _prompts()), expected, range(len(_prompts())))
    assert calls, "the fused path never ran"
