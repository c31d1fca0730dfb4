"""CPU-only reorganisations of the same math: the vision tower in groups of patches, MLPs in row slices. They
must not change results (beyond fp32 rounding) and must keep every item's rows apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlserve.engine import encoder_runner
from vlserve.engine.encoder_runner import EncoderRunner, batches
from vlserve.model.layers import mlp as mlp_module
from vlserve.model.layers.mlp import GatedMLP, in_row_slices
from vlserve.model.loader import load_model


def _item(key: str, patches: int, grid=(1, 2, 2)):
    return SimpleNamespace(mm_hash=key, pixel_values=torch.zeros(patches, 4), layout=grid)


def test_batches_respect_the_patch_budget():
    items = [_item("a", 300), _item("b", 300), _item("c", 900), _item("d", 100)]
    groups = batches(items, 700)
    assert [[it.mm_hash for it in g] for g in groups] == [["a", "b"], ["c"], ["d"]]  # c alone: over budget
    assert batches(items, None) == [items]


def test_gated_mlp_in_row_slices_matches_one_pass(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, "silu", bias=True)
    x = torch.randn(70, 32)
    with torch.inference_mode():
        whole = mlp._rows(x)
        monkeypatch.setattr(mlp_module, "CPU_ROWS_PER_SLICE", 16)
        sliced = mlp(x)
    assert torch.allclose(sliced, whole, atol=1e-6)
    assert torch.equal(in_row_slices(lambda t: t * 2, x), x * 2)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_vision_tower_in_groups_gives_each_item_its_rows(tiny_ckpt, monkeypatch, arch):
    """Items encoded in small groups get the rows they get in one call (no attention across items either way)."""
    model = load_model(tiny_ckpt(arch), dtype="float32")
    patch_dim = model.cfg.vision.patch_dim
    gen = torch.Generator().manual_seed(0)
    grids = [(1, 4, 4), (1, 6, 4), (1, 4, 8), (1, 2, 2)]
    items = [SimpleNamespace(mm_hash=f"i{n}", pixel_values=torch.randn(t * h * w, patch_dim, generator=gen),
                             layout=(t, h, w), audio_features=None) for n, (t, h, w) in enumerate(grids)]
    together = EncoderRunner(model, torch.device("cpu"))
    monkeypatch.setattr(encoder_runner, "CPU_PATCHES_PER_CALL", 10**9)
    together.encode(items)
    grouped = EncoderRunner(model, torch.device("cpu"))
    monkeypatch.setattr(encoder_runner, "CPU_PATCHES_PER_CALL", 30)
    grouped.encode(items)
    assert len(grouped.timers) > 1 and len(together.timers) == 1
    for it in items:
        assert torch.allclose(grouped.outputs[it.mm_hash], together.outputs[it.mm_hash], atol=1e-5)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_engine_without_the_kernels_gives_the_same_tokens(tiny_ckpt, monkeypatch, quantization):
    """The torch fallbacks (no compiler, VLSERVE_CPU_KERNELS=0) run everywhere and compute what the kernels do:
    a mixed picture + text batch gives the same greedy tokens either way, fp32, and the pools come back full."""
    from tests.conftest import IMG, assert_pool_full, noise_image
    from vlserve import LLM, SamplingParams
    from vlserve.model.kernels import cpu_kernels

    prompts = [{"prompt": f"<|im_start|>user\n{IMG}Describe.<|im_end|>\n<|im_start|>assistant\n",
                "multi_modal_data": {"image": [noise_image(84, 56, 3)]}}, "plain text, somewhat longer than that"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    extra = {"quantization": quantization} if quantization else {}
    tokens = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.DISABLE_ENV, flag)
        cpu_kernels.load.cache_clear()
        try:
            llm = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=64, **extra)
            tokens[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_pool_full(llm)
        finally:
            cpu_kernels.load.cache_clear()
    assert tokens["1"] == tokens["0"]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_vision_attention_by_gemm_blocks_matches_sdpa(monkeypatch, native_bf16):
    """bf16 ViT attention as GEMMs per block of queries (CPUs with native bf16): the fp32 reference within bf16
    rounding, masks honoured, blocks smaller than the sequence; without native bf16 it is torch's SDPA itself."""
    import dataclasses

    import torch.nn.functional as F

    from vlserve.model import hardware, vision_common

    hw = dataclasses.replace(hardware.detect(), native_bf16=native_bf16)
    monkeypatch.setattr(vision_common, "detect", lambda: hw)
    monkeypatch.setattr(vision_common, "GEMM_ATTENTION_SCORES", 2 * 4 * 64 * 40)  # 40 query rows per block
    torch.manual_seed(0)
    qkv = torch.randn(2, 100, 3, 4, 16)  # token-major like the tower's views
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    mask = (torch.arange(100) < torch.tensor([[100], [64]]))[:, None, None, :]
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        got = vision_common.attention(*(x.to(torch.bfloat16) for x in (q, k, v)), m)
        if not native_bf16:
            assert torch.equal(got, F.scaled_dot_product_attention(*(x.to(torch.bfloat16) for x in (q, k, v)),
                                                                   attn_mask=m))
        assert (got.float() - want).abs().max() < 0.03
        assert torch.equal(vision_common.attention(q, k, v, m), want)  # fp32: always torch's kernel
