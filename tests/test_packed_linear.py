"""oneDNN-prepacked bf16 linears must give exactly what nn.Linear gives, alone and through the whole engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.conftest import IMG, noise_image
from vlserve import LLM, SamplingParams
from vlserve.model.layers.packed_linear import (
    PackedLinear,
    pack_linears,
    packed_linear_supported,
)

pytestmark = pytest.mark.skipif(not packed_linear_supported(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN bf16 weight packing needs AVX-512 (or AVX-NE-CONVERT); this CPU's "
                                "fallback path is tested in test_hardware.py")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64), (300, 64)])
def test_packed_linear_is_bit_identical(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    packed = PackedLinear(lin.weight, lin.bias)
    with torch.inference_mode():
        assert torch.equal(packed(x), lin(x))


def test_pack_linears_swaps_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 4))).to(torch.bfloat16)
    assert pack_linears(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])  # qwen3_vl_moe: MoE experts packed too
def test_engine_tokens_identical_with_and_without_packing(tiny_ckpt, monkeypatch, arch):
    prompt = {"prompt": f"<|im_start|>user\n{IMG}Describe.<|im_end|>\n<|im_start|>assistant\n",
              "multi_modal_data": {"image": [noise_image(84, 56, 3)]}}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("VLSERVE_PACKED_LINEAR", flag)
        llm = LLM(str(tiny_ckpt(arch)), dtype="bfloat16", num_kv_blocks=64)
        model = llm.engine.core.runner.model
        packed = any(isinstance(m, PackedLinear) for m in model.modules())
        assert packed == (flag == "1")
        experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
        assert all((m.packed is not None) == (flag == "1") for m in experts)
        outs[flag] = llm.generate([prompt, "plain text"], params, use_tqdm=False)
    for a, b in zip(outs["1"], outs["0"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
