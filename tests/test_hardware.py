"""What the hardware computes natively decides dtype="auto" and packed linears, on both CPU kinds.

The AVX2-only path runs everywhere: VLSERVE_CPU_ISA=avx2 makes this process behave like such a CPU (it can
only lower what the CPU has). Tests that need native bf16 skip with a reason where it is missing."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch

from tests.conftest import IMG, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.engine.config import MIN_DEFAULT_KV_BYTES, kv_bytes_per_token, resolve_config
from vlserve.model import hardware
from vlserve.model.gemm_rates import GemmRates
from vlserve.model.hardware import Hardware, resolve_dtype
from vlserve.model.layers.moe import Experts
from vlserve.model.layers.packed_linear import PackedLinear, packed_linear_supported

AVX2 = Hardware("avx2", native_bf16=False, native_fp16=False, onednn_bf16_packing=False, cuda_devices=0,
                cuda_name=None, cuda_bf16=False, capped=False)
AVX512_BF16 = dataclasses.replace(AVX2, cpu_isa="avx512_bf16", native_bf16=True, onednn_bf16_packing=True)
AMX_FP16 = dataclasses.replace(AVX512_BF16, cpu_isa="amx", native_fp16=True)
CPU = torch.device("cpu")


BF16_FASTER = GemmRates(fp32_ms=30.0, bf16_ms=12.0, fp32_gflops=300.0, bf16_gflops=900.0)  # AMX-like
FP32_FASTER = GemmRates(fp32_ms=30.0, bf16_ms=41.0, fp32_gflops=304.0, bf16_gflops=169.0)  # AVX-512-BF16, no AMX


@pytest.fixture
def fake_hw(monkeypatch):
    def use(hw: Hardware):
        monkeypatch.setattr(hardware, "detect", lambda: hw)
    return use


@pytest.fixture
def avx2_process(monkeypatch):
    """This process behaves like an AVX2-only CPU."""
    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    hardware.detect.cache_clear()
    yield
    hardware.detect.cache_clear()


@pytest.mark.parametrize("hw,ckpt,expected", [
    (AVX512_BF16, "bfloat16", torch.bfloat16),
    (AVX2, "bfloat16", torch.float32),  # emulated bf16 is ~100x slower than fp32 there
    (AVX512_BF16, "float16", torch.bfloat16),  # same footprint, computed natively
    (AVX2, "float16", torch.float32),
    (AMX_FP16, "float16", torch.float16),
    (AVX2, None, torch.float32),
    (AVX2, "float32", torch.float32),
])
def test_auto_dtype_follows_native_support(fake_hw, hw, ckpt, expected):
    fake_hw(hw)
    assert resolve_dtype("auto", ckpt, CPU) == expected


def test_auto_takes_bf16_only_where_it_also_runs_faster_here(fake_hw, caplog):
    """Native bf16 that multiplies slower than fp32 (a Xeon with AVX-512-BF16 but no AMX: 169 vs 304 GFLOP/s) is
    not picked: the log says what was measured. An explicit bfloat16 stays honoured."""
    fake_hw(AVX512_BF16)
    slower, faster = (lambda isa: FP32_FASTER), (lambda isa: BF16_FASTER)
    with caplog.at_level(logging.INFO, logger="vlserve.hardware"):
        assert resolve_dtype("auto", "bfloat16", CPU, measure=slower) == torch.float32
        assert resolve_dtype("auto", "float16", CPU, measure=slower) == torch.float32  # (its bf16 stand-in too)
    assert "bf16 169 vs fp32 304 GFLOP/s" in caplog.text and "float32, not the checkpoint's bfloat16" in caplog.text
    assert resolve_dtype("bfloat16", "bfloat16", CPU, measure=slower) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", CPU, measure=faster) == torch.bfloat16
    fake_hw(AVX2)  # emulated: nothing to measure
    assert resolve_dtype("auto", "bfloat16", CPU, measure=lambda isa: pytest.fail("measured")) == torch.float32


def test_a_servers_dtype_decision_measures_the_gemms(monkeypatch, tiny_ckpt):
    """resolve_model_facts (what every server and LLM resolves its options with) gives the measurement."""
    from vlserve.model import facts

    monkeypatch.setattr(hardware, "detect", lambda: AVX512_BF16)
    monkeypatch.setattr(facts, "cached_rates", lambda isa: FP32_FASTER)
    ckpt = tiny_ckpt("qwen2_vl")  # (its weights are float32: its config is made to say bfloat16)
    monkeypatch.setattr(facts, "load_model_config",
                        lambda path, real=facts.load_model_config: dataclasses.replace(real(path),
                                                                                        checkpoint_dtype="bfloat16"))
    assert facts.resolve_model_facts(EngineArgs(model=str(ckpt), dtype="auto"), announce=False).dtype == "float32"
    monkeypatch.setattr(facts, "cached_rates", lambda isa: BF16_FASTER)
    assert facts.resolve_model_facts(EngineArgs(model=str(ckpt), dtype="auto"), announce=False).dtype == "bfloat16"


def test_gemm_rates_are_measured_once_and_shared_through_the_cache(monkeypatch, tmp_path):
    from vlserve.model import gemm_rates

    monkeypatch.setenv("VLSERVE_KERNEL_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(gemm_rates, "measure", lambda: calls.append(1) or FP32_FASTER)
    assert gemm_rates.cached_rates("avx512_bf16") == FP32_FASTER
    assert gemm_rates.cached_rates("avx512_bf16") == FP32_FASTER and len(calls) == 1  # read back
    assert gemm_rates.cached_rates("amx") == FP32_FASTER and len(calls) == 2  # another key
    for cached in tmp_path.glob("gemm-rates-*.json"):
        cached.write_text('{"fp32_ms": "x", "bf16_ms": 1, "fp32_gflops": 1, "bf16_gflops": 1}')  # damaged
    assert gemm_rates.cached_rates("avx512_bf16") == FP32_FASTER and len(calls) == 3  # measured again
    # a kernel cache this user cannot write (the container image's): kept in the user's own cache instead
    monkeypatch.setattr(gemm_rates, "_folders", lambda: [tmp_path / "no" / "such" / "file", tmp_path / "own"])
    (tmp_path / "no").write_text("a file, not a folder")
    assert gemm_rates.cached_rates("amx") == FP32_FASTER and len(calls) == 4
    assert gemm_rates.cached_rates("amx") == FP32_FASTER and len(calls) == 4  # read back from the second
    assert list((tmp_path / "own").glob("gemm-rates-*.json"))


def test_gemm_rates_near_parity_keep_bf16_and_a_failed_measurement_keeps_the_flags(monkeypatch, caplog, tmp_path,
                                                                                   fake_hw):
    from vlserve.model import gemm_rates

    assert GemmRates(fp32_ms=10.0, bf16_ms=11.0, fp32_gflops=1.0, bf16_gflops=1.0).bf16_pays  # within 15 %
    assert not GemmRates(fp32_ms=10.0, bf16_ms=12.0, fp32_gflops=1.0, bf16_gflops=1.0).bf16_pays
    monkeypatch.setenv("VLSERVE_KERNEL_CACHE", str(tmp_path))

    def broken():
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(gemm_rates, "measure", broken)
    with caplog.at_level(logging.WARNING, logger="vlserve.hardware"):
        assert gemm_rates.cached_rates("avx512_bf16") is None
    assert "could not be measured" in caplog.text
    fake_hw(AVX512_BF16)
    assert resolve_dtype("auto", "bfloat16", CPU, measure=lambda isa: None) == torch.bfloat16  # the flags alone


@pytest.mark.skipif(not hardware.detect().native_bf16, reason="bf16 is emulated here (measured only where native)")
def test_gemm_rates_measure_the_linears_the_model_runs():
    from vlserve.model import gemm_rates

    rates = gemm_rates.measure()
    assert rates.fp32_gflops > 0 and rates.bf16_gflops > 0 and rates.fp32_ms > 0 and rates.bf16_ms > 0
    assert "GFLOP/s" in rates.describe()


def test_auto_fallback_and_explicit_emulation_are_logged(fake_hw, caplog):
    fake_hw(AVX2)
    with caplog.at_level(logging.INFO, logger="vlserve.hardware"):
        assert resolve_dtype("auto", "bfloat16", CPU) == torch.float32
        assert resolve_dtype("bfloat16", "bfloat16", CPU) == torch.bfloat16  # honoured...
    assert "running float32" in caplog.text
    assert "emulated and slow" in caplog.text  # ... with a warning
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype("float8", None, CPU)


def test_isa_cap_only_lowers(monkeypatch):
    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    hardware.detect.cache_clear()
    try:
        hw = hardware.detect()
        assert hw.cpu_isa in ("avx2", "default") and not hw.native_bf16 and not hw.onednn_bf16_packing
        assert not packed_linear_supported(CPU, torch.bfloat16)
        monkeypatch.setenv(hardware.ISA_ENV, "warp-drive")
        hardware.detect.cache_clear()
        with pytest.raises(InvalidInputError, match="VLSERVE_CPU_ISA"):
            hardware.detect()
    finally:
        hardware.detect.cache_clear()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl_moe"])  # MoE: its experts pack (or not) too
def bf16_ckpt(request, tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint as a bf16 checkpoint (config dtype), like every released Qwen-VL."""
    folder = tmp_path_factory.mktemp("bf16")
    shutil.copytree(tiny_ckpt(request.param), folder, dirs_exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


PROMPT = {"prompt": f"<|im_start|>user\n{IMG}Describe.<|im_end|>\n<|im_start|>assistant\n",
          "multi_modal_data": {"image": [noise_image(84, 56, 3)]}}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _linear_kinds(llm) -> set[type]:
    return {type(m) for m in llm.engine.core.runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}


def _experts_packed(llm) -> set[bool]:
    """For each MoE expert group of the model: whether its experts were prepacked (empty for dense models)."""
    return {m.packed is not None for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)}


def test_avx2_auto_runs_float32_and_explicit_bf16_runs_unpacked(avx2_process, bf16_ckpt):
    auto = LLM(str(bf16_ckpt), num_kv_blocks=64)
    assert auto.config.dtype == torch.float32
    assert PackedLinear in _linear_kinds(auto)  # fp32 weights are prepacked on every CPU oneDNN runs on
    explicit = LLM(str(bf16_ckpt), dtype="bfloat16", num_kv_blocks=64)
    assert explicit.config.dtype == torch.bfloat16
    assert _linear_kinds(explicit) == {torch.nn.Linear}  # no oneDNN packing: it raises on real AVX2 CPUs
    assert True not in _experts_packed(explicit)
    for llm in (auto, explicit):
        out = llm.generate([PROMPT, "plain text"], PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in out)


@pytest.mark.skipif(not hardware.detect().native_bf16, reason="needs a CPU with native bf16 (AVX-512-BF16 or AMX)")
def test_native_bf16_auto_keeps_bf16_and_packs(bf16_ckpt, monkeypatch):
    """Where bf16 is native and measured faster (AMX: 2,292 vs 409 GFLOP/s); a CPU whose native bf16 measures
    slower (AVX-512-BF16 without AMX) runs fp32, also packed. The measurement itself is given here, so the test
    says the same on either kind."""
    from vlserve.model import facts

    monkeypatch.setattr(facts, "cached_rates", lambda isa: BF16_FASTER)
    llm = LLM(str(bf16_ckpt), num_kv_blocks=64)
    assert llm.config.dtype == torch.bfloat16
    assert PackedLinear in _linear_kinds(llm)
    assert False not in _experts_packed(llm)
    monkeypatch.setattr(facts, "cached_rates", lambda isa: FP32_FASTER)
    slower = LLM(str(bf16_ckpt), num_kv_blocks=64)
    assert slower.config.dtype == torch.float32 and PackedLinear in _linear_kinds(slower)


def test_default_kv_cache_scales_with_the_model(tiny_ckpt):
    """No size given: as large as the weights (at least MIN_DEFAULT_KV_BYTES), never more than max_num_seqs x
    max_model_len need, never less than one full-length sequence; the flags still override."""
    path = str(tiny_ckpt("qwen2_vl"))
    cfg = resolve_config(EngineArgs(model=path, dtype="float32"))
    per_block = kv_bytes_per_token(cfg.model, cfg.dtype) * cfg.block_size
    need_blocks = cfg.max_num_seqs * cfg.max_model_len // cfg.block_size
    assert cfg.num_kv_blocks == min(need_blocks, MIN_DEFAULT_KV_BYTES // per_block)  # a 0.3M-param model
    assert cfg.num_kv_blocks * per_block <= 2**30  # the old default took 2 GiB for the same model
    small = resolve_config(EngineArgs(model=path, dtype="float32", max_num_seqs=2, max_model_len=256))
    assert small.num_kv_blocks == 2 * 256 // cfg.block_size  # all that two 256-token sequences can use
    assert resolve_config(EngineArgs(model=path, num_kv_blocks=40)).num_kv_blocks == 40
    gb = resolve_config(EngineArgs(model=path, dtype="float32", kv_cache_memory_gb=0.01))
    assert gb.num_kv_blocks == int(0.01 * 2**30) // per_block
