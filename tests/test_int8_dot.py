"""int8 x int8 decode linears (the CPU kernel's few rows): activations quantized in blocks of 32 values, bytes
multiplied by bytes (AVX-512 VNNI, AVX2). Checked against a float64 reference built here from the same codes, row by
row (a row's result does not depend on the rows beside it), the fallbacks (the switch, an ISA without the
instructions, widths the blocks do not divide), and a model's logits through decode-sized passes."""

from __future__ import annotations

import pytest
import torch

from vlserve.model.hf_config import load_model_config
from vlserve.model.layers import int8_gemm
from vlserve.model.layers.quantized_linear import Int8Linear, deinterleave4
from vlserve.tools.logit_quality import deviation, random_sequences, teacher_forced_logits

BLOCK = int8_gemm.DOT_BLOCK


def caps_with_dot_products(kernels) -> list[int]:
    """The ISA caps (1 AVX2, 3 the best) under which this CPU has a dot-product kernel, each path once."""
    by_path = {kernels.int8_dot_isa(cap): cap for cap in (1, 3)}
    by_path.pop(0, None)
    if not by_path:
        pytest.skip("no AVX2 on this CPU: int8 decode keeps fp32 activations")
    return sorted(by_path.values())


@pytest.fixture
def fresh_choice():
    int8_gemm.clear_cached_choices()
    yield
    int8_gemm.clear_cached_choices()


def reference(x: torch.Tensor, linear: Int8Linear) -> torch.Tensor:
    """Each block of 32 values scaled so its largest magnitude is 127 (fp32 arithmetic, ties to even: the kernel's
    codes exactly), the integer sums in float64, scaled back by block and by output row."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = 127.0 / top
    inv = torch.where(inv.isfinite(), inv, torch.zeros_like(inv))  # zero blocks, and ones too small to invert
    codes = torch.round(blocks * inv).double()
    w = deinterleave4(linear.qweight).double().view(-1, k // BLOCK, BLOCK)
    sums = torch.einsum("mbk,nbk->mnb", codes, w)  # exact: integers far below 2^53
    return (sums * (top / 127.0).double().view(m, 1, -1)).sum(-1) * linear.scale.double()


def int8_linear(n: int, k: int, seed: int) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear.from_weight(torch.randn(n, k))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("k, n", [(32, 4), (96, 12), (1024, 68)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_the_block_sums_scaled(kernels, rows, k, n, dtype):
    linear = int8_linear(n, k, rows + k)
    x = (torch.randn(rows, k) * torch.logspace(-3, 2, k)).to(dtype)  # blocks of very different sizes
    want = reference(x, linear)
    for cap in caps_with_dot_products(kernels):
        got = kernels.int8_dot_linear(x, linear.qweight, linear.scale, cap)
        assert got.shape == (rows, n) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        else:
            torch.testing.assert_close(got, want.to(dtype))


def test_a_row_is_the_same_whatever_rows_share_its_call(kernels):
    """Row tiles of 4 (AVX-512) or 2 (AVX2) and single rows add in the same order: bit-equal results."""
    linear = int8_linear(64, 256, 0)
    x = torch.randn(7, 256)
    for cap in caps_with_dot_products(kernels):
        together = kernels.int8_dot_linear(x, linear.qweight, linear.scale, cap)
        for i in range(7):
            alone = kernels.int8_dot_linear(x[i:i + 1], linear.qweight, linear.scale, cap)
            assert torch.equal(alone, together[i:i + 1])


def test_non_finite_values_make_their_row_nan_and_zero_rows_zero(kernels):
    linear = int8_linear(8, 64, 1)
    x = torch.randn(5, 64)
    x[1, 40], x[2, 3], x[3] = float("nan"), float("inf"), 0.0
    x[4], x[4, :32] = 0.0, 1e-37  # a block too small to invert (127 / 1e-37 overflows): zeros, not saturated codes
    for cap in caps_with_dot_products(kernels):
        y = kernels.int8_dot_linear(x, linear.qweight, linear.scale, cap)
        assert y[0].isfinite().all() and y[1].isnan().all() and y[2].isnan().all() and torch.equal(y[3], torch.zeros(8))
        assert torch.equal(y[4], torch.zeros(8))


def test_widths_the_kernel_cannot_take_are_refused(kernels):
    linear = Int8Linear.from_weight(torch.randn(8, 48))
    for cap in caps_with_dot_products(kernels):
        with pytest.raises(RuntimeError, match="K % 32"):
            kernels.int8_dot_linear(torch.randn(1, 48), linear.qweight, linear.scale, cap)


def test_the_linear_takes_dot_products_for_decode_rows_unless_switched_off(kernels, monkeypatch, fresh_choice):
    from vlserve.model.kernels import cpu_kernels

    monkeypatch.setenv(int8_gemm.ENV_SWITCH, "1")  # (whatever the runner's environment says)
    int8_gemm.clear_cached_choices()
    cap = cpu_kernels.isa_cap()
    linear = Int8Linear.from_weight(torch.randn(16, 64), torch.randn(16))
    x = torch.randn(3, 64)
    weight_only = kernels.int8_linear(x, linear.qweight, linear.scale, cap) + linear.bias
    if kernels.int8_dot_isa(cap):
        assert int8_gemm.decode_dot_isa(cap) == kernels.int8_dot_isa(cap)
        assert torch.equal(linear(x), kernels.int8_dot_linear(x, linear.qweight, linear.scale, cap) + linear.bias)
        assert not torch.equal(linear(x), weight_only)  # the activations' rounding shows
    else:
        assert torch.equal(linear(x), weight_only)
    narrow = Int8Linear.from_weight(torch.randn(8, 48))  # 48 values: no whole blocks, the float kernel
    assert torch.equal(narrow(x[:, :48]), kernels.int8_linear(x[:, :48], narrow.qweight, narrow.scale, cap))
    monkeypatch.setenv(int8_gemm.ENV_SWITCH, "0")
    int8_gemm.clear_cached_choices()
    assert int8_gemm.decode_dot_isa(cap) == 0 and torch.equal(linear(x), weight_only)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_decode_sized_passes_stay_close_to_the_full_precision_model(tiny_ckpt, arch, kernels, fresh_choice):
    """Teacher-forced text in passes of 8 tokens (the decode kernels' rows): int8 with quantized activations stays
    about as close to the unquantized model as weight-only int8 (bounds a few times what the tiny models give)."""
    path = tiny_ckpt(arch)
    sequences = random_sequences(load_model_config(str(path)).text.vocab_size, 128, 64)
    reference_logits = teacher_forced_logits(path, None, "float32", sequences)
    dot = deviation(teacher_forced_logits(path, "int8", "float32", sequences, rows_per_pass=8), reference_logits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(int8_gemm.ENV_SWITCH, "0")
        int8_gemm.clear_cached_choices()
        weight_only = deviation(teacher_forced_logits(path, "int8", "float32", sequences, rows_per_pass=8),
                                reference_logits)
    assert weight_only.cosine > 0.999 and weight_only.top1_agreement > 0.85, weight_only
    assert dot.cosine > 0.995 and dot.top1_agreement > 0.8 and dot.kl_mean < 3 * weight_only.kl_mean + 1e-4, dot
