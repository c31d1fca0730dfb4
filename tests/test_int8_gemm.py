"""int8 x int8 prefill GEMMs (activations quantized per row): exact integer arithmetic against a float64
reference, the probe that picks 8- or 7-bit activations by what the library computes exactly, and the quality of a
whole model against its unquantized self."""

from __future__ import annotations

import time

import pytest
import torch

from vlserve.model.hf_config import load_model_config
from vlserve.model.layers import int8_gemm
from vlserve.model.layers.quantized_linear import KERNEL_MAX_ROWS, Int8Linear, deinterleave4, interleave4
from vlserve.tools.logit_quality import deviation, random_sequences, teacher_forced_logits


@pytest.fixture
def fresh_probe():
    """activation_bits() asked again in the test and again after it (it is cached per process)."""
    int8_gemm.clear_cached_choices()
    yield
    int8_gemm.clear_cached_choices()


def skip_unless_exact(bits: int) -> None:
    """7-bit codes multiply exactly everywhere torch computes them (the probe checks it where it picks them); 8-bit
    ones where the library's pair sums do not saturate: asked of the library, as the probe does."""
    if bits == 8 and not int8_gemm._exact(8, 40, 256, 64):
        pytest.skip("8-bit products saturate here (oneDNN without VNNI)")


def _reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The same codes and scales, multiplied in float64 (exact for these integer sums)."""
    codes, row_scale = int8_gemm.quantize_rows(x, bits)
    return (codes.double() @ w.double().t()) * row_scale.double() * scale.double()


@pytest.mark.parametrize("bits", [8, 7])
@pytest.mark.parametrize("rows, k, n, chunk", [(40, 64, 32, 8192), (3, 256, 100, 24), (130, 48, 12, 4)])
def test_products_are_the_exact_integer_sums_scaled(bits, rows, k, n, chunk):
    skip_unless_exact(bits)
    torch.manual_seed(rows)
    x = torch.randn(rows, k) * torch.logspace(-3, 2, rows)[:, None]  # rows of very different magnitudes
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01
    got = int8_gemm.int8_linear(x, lambda a, b: w[a:b], n, scale, bits, chunk)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), _reference(x, w, scale, bits), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [8, 7])
def test_rows_are_quantized_to_their_own_largest_value(bits):
    top = 2 ** (bits - 1) - 1
    x = torch.randn(5, 96) * torch.tensor([1e-4, 1.0, 30.0, 0.0, 1e3])[:, None]
    x[4, 7] = -5e3  # the largest magnitude is a negative value
    codes, scale = int8_gemm.quantize_rows(x.to(torch.bfloat16), bits)
    xf = x.to(torch.bfloat16).float()
    assert codes.dtype == torch.int8 and scale.shape == (5, 1)
    assert codes.abs().max() <= top and codes[3].eq(0).all() and scale[3].item() == torch.finfo(torch.float32).tiny
    assert codes.abs().amax(1)[[0, 1, 2, 4]].eq(top).all()  # each nonzero row uses the whole range
    assert codes[4, 7].item() == -top
    assert ((codes.float() * scale - xf).abs() <= scale / 2 * (1 + 1e-6)).all()  # within half a step


def _saturating_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What oneDNN computes without VNNI: the left operand shifted to unsigned, pairs of products summed in 16
    bits with saturation (vpmaddubsw), then the shift taken back out."""
    au, bl = a.long() + 128, b.long()
    pairs = au[:, 0::2, None] * bl[0::2][None] + au[:, 1::2, None] * bl[1::2][None]
    return (pairs.clamp(-32768, 32767).sum(1) - 128 * bl.sum(0)).to(torch.int32)


def test_the_probe_picks_7_bits_where_8_bit_products_saturate(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm)
    monkeypatch.setattr(int8_gemm, "_speeds", lambda bits: (1.0, 10.0))  # (the emulation is slow: not timed)
    assert int8_gemm.activation_bits() == 7
    torch.manual_seed(0)  # and the 7-bit order really is exact on such a machine
    x, w, scale = torch.randn(40, 64), torch.randint(-127, 128, (16, 64), dtype=torch.int8), torch.rand(16)
    torch.testing.assert_close(int8_gemm.int8_linear(x, lambda a, b: w[a:b], 16, scale, 7, 8192).double(),
                               _reference(x, w, scale, 7), rtol=1e-6, atol=0)


def test_exact_but_slow_products_are_not_used(monkeypatch, fresh_probe):
    """torch runs `_int_mm` as a plain loop on CPUs without VNNI: exact, and far slower than the weight-only path.
    The probe times it against an fp32 GEMM and keeps the weights expanded there."""
    exact = torch._int_mm

    def slow(a, b):
        time.sleep(0.02)
        return exact(a, b)

    monkeypatch.setattr(torch, "_int_mm", slow)
    assert int8_gemm.activation_bits() == 0
    int8_gemm.activation_bits.cache_clear()
    monkeypatch.undo()
    with torch.backends.mkldnn.flags(enabled=False):  # torch's own plain loop, as on such a CPU
        assert int8_gemm.activation_bits() == 0


def test_the_probe_refuses_wrong_products_and_obeys_the_switch(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: _saturating_int_mm(a, b) + 1)
    assert int8_gemm.activation_bits() == 0
    int8_gemm.activation_bits.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv(int8_gemm.ENV_SWITCH, "0")
    assert int8_gemm.activation_bits() == 0


def test_the_saturation_model_is_the_machine_s_where_it_has_no_vnni():
    """The emulation above agrees with the library wherever the library's 8-bit products are exact or not."""
    a = torch.full((40, 256), 127, dtype=torch.int8)
    b = torch.full((256, 64), 127, dtype=torch.int8)
    emulated = _saturating_int_mm(a, b)
    assert not torch.equal(emulated.long(), a.long() @ b.long())  # it does saturate
    if not int8_gemm._exact(8, 40, 256, 64):  # the library saturates here: exactly as emulated
        assert torch.equal(torch._int_mm(a, b), emulated)


def test_deinterleave_moves_every_byte_pattern_unchanged():
    """The complex128 copy moves bits only: NaN patterns of float64 (bytes 0xff...) come out as they went in."""
    w = torch.arange(256, dtype=torch.uint8).repeat(32, 4).view(torch.int8)[:, :1024].contiguous()  # [32, 1024]
    w[::3] = -1  # all-ones bytes: float64 NaNs
    assert torch.equal(deinterleave4(interleave4(w)), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_takes_many_rows_as_int8_products(dtype, fresh_probe):
    """Past the kernel's rows, on CPU: the int8 x int8 path (any leading shape), within quantization error of the
    float layer, and exactly the reference arithmetic."""
    if not int8_gemm.activation_bits():
        pytest.skip("no exact int8 products on this machine")
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=True)
    q = Int8Linear.from_linear(lin).to(dtype)
    x = torch.randn(3, KERNEL_MAX_ROWS, 128).to(dtype)
    with torch.inference_mode():
        got = q(x)
        want = lin(x.float())
    assert got.shape == (3, KERNEL_MAX_ROWS, 64) and got.dtype == dtype and got.is_contiguous()
    exact = _reference(x.reshape(-1, 128), deinterleave4(q.qweight), q.scale, int8_gemm.activation_bits())
    torch.testing.assert_close(got.reshape(-1, 64).double(), (exact + q.bias.double()).to(dtype).double(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2 if dtype == torch.bfloat16
                               else 1e-6)
    assert ((got.float() - want).norm() / want.norm()) < 0.03


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_an_int8_model_stays_close_to_its_full_precision_self(tiny_ckpt, arch, fresh_probe):
    """Teacher-forced text through the unquantized model, weight-only int8 and int8 activations too: the logits
    stay close (bounds a few times what was measured on the tiny models: cosine 0.997-0.9996), and most greedy
    tokens agree. What `benchmarks/quantization.py` prints for a larger model."""
    path = tiny_ckpt(arch)
    sequences = random_sequences(load_model_config(str(path)).text.vocab_size, 256, 64)
    reference = teacher_forced_logits(path, None, "float32", sequences)
    with_activations = deviation(teacher_forced_logits(path, "int8", "float32", sequences), reference)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(int8_gemm.ENV_SWITCH, "0")
        int8_gemm.clear_cached_choices()
        weight_only = deviation(teacher_forced_logits(path, "int8", "float32", sequences), reference)
    for d in (with_activations, weight_only):
        assert d.cosine > 0.99 and d.top1_agreement > 0.75 and d.max_abs_relative < 0.3, d
    assert weight_only.cosine > 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 7])
@pytest.mark.parametrize("cap", [0, 1, 3])
def test_the_kernels_quantize_and_scale_exactly_as_the_torch_passes(kernels, monkeypatch, dtype, bits, cap):
    """The one-pass kernels (scalar, AVX2 and AVX-512 row quantization: the ISA cap picks) and the torch fallback
    give the same codes, scales and outputs, bit for bit (ties rounded half to even, zero rows, NaN and infinite
    values, a width no vector divides, both product layouts)."""
    from vlserve.model.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "isa_cap", lambda: cap)
    torch.manual_seed(bits)
    x = (torch.randn(37, 203) * torch.logspace(-4, 3, 37)[:, None]).to(dtype)
    x[5] = 0
    x[7, 3] = float("nan")  # its row's scale is NaN, its codes 0, either way
    x[8, 200] = float("inf")  # its row's scale is infinite, its codes 0
    x[6, :4] = torch.tensor([2.5, -2.5, 0.5, 2.0 ** (bits - 1) - 1]).to(dtype)  # ties at scale 1 (its largest: top)
    acc = torch.randint(-2**20, 2**20, (37, 70), dtype=torch.int32)
    row, col = torch.rand(37, 1), torch.rand(70)
    fast = int8_gemm.quantize_rows(x, bits), [int8_gemm.scale_products(p, row, col, dtype) for p in
                                               (acc, acc.t().contiguous().t())]
    monkeypatch.setattr(cpu_kernels, "for_tensor", lambda t, dtypes=None: None)
    slow = int8_gemm.quantize_rows(x, bits), [int8_gemm.scale_products(acc, row, col, dtype)]
    assert torch.equal(fast[0][0], slow[0][0]) and fast[0][1][7].isnan().all() and not fast[0][0][7:9].any()
    torch.testing.assert_close(fast[0][1], slow[0][1], rtol=0, atol=0, equal_nan=True)
    assert fast[0][0][6, :3].tolist() == [2, -2, 0] and fast[0][1][6].item() == 1  # half to even
    for out in fast[1]:
        assert out.dtype == dtype and out.is_contiguous() and torch.equal(out, slow[1][0])
