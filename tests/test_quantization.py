"""Weight-only quantization: int8 made at load time, AWQ / GPTQ int4 checkpoints, and their failure paths.

The int4 checkpoints are written by vlserve.tools.int4_export in the released repos' layouts; the loader is
checked against a dequantization written here from the formats' definitions (not vlserve's unpacking code).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.model.layers.quantized_linear import Int4Linear, Int8Linear
from vlserve.model.loader import load_model
from vlserve.model.quantization import resolve_quantization
from vlserve.tools import int4_export
from vlserve.tools.int4_export import export_int4, fitting_group_sizes

GROUP = 32  # the tiny models' widths are 64 and 128; released checkpoints use 128 (same code path)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt": f"<|im_start|>user\n{IMG}Describe.<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": [noise_image(84, 56, 3)]}},
           "plain text, a little longer than the other prompt"]
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
OURS = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


@pytest.fixture(scope="module")
def int4_ckpt(tiny_ckpt, tmp_path_factory):
    made = {}

    def get(arch: str, method: str):
        if (arch, method) not in made:
            made[arch, method] = export_int4(tiny_ckpt(arch), tmp_path_factory.mktemp(f"{arch}-{method}"), method,
                                             GROUP)
        return made[arch, method]

    return get


# ---- reference dequantization, straight from the formats' definitions ------------------------------------
def _nibble(words: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    return (words.long() >> (4 * index)) & 15


def reference_awq(t: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    """AutoAWQ gemm: qweight [K, N/8]; output channel n sits in word n // 8 at nibble position
    [0, 2, 4, 6, 1, 3, 5, 7].index(n % 8); zeros packed the same way. W[n, k] = (q - z) * s."""
    qweight, qzeros, scales = t[f"{base}.qweight"], t[f"{base}.qzeros"], t[f"{base}.scales"].float()
    k, n = qweight.shape[0], qweight.shape[1] * 8
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    pos = torch.tensor([order.index(c % 8) for c in range(n)])
    q = _nibble(qweight[:, torch.arange(n) // 8], pos)  # [K, N]
    z = _nibble(qzeros[:, torch.arange(n) // 8], pos)  # [G, N]
    g = torch.arange(k) // GROUP
    return ((q - z[g]) * scales[g]).t()


def reference_gptq(t: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    """AutoGPTQ: qweight [K/8, N], input channel k in word k // 8 at nibble k % 8; zeros [G, N/8], output channel
    n at nibble n % 8, stored minus one; group of channel k is g_idx[k]."""
    qweight, qzeros, scales = t[f"{base}.qweight"], t[f"{base}.qzeros"], t[f"{base}.scales"].float()
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q = _nibble(qweight[torch.arange(k) // 8], (torch.arange(k) % 8)[:, None])  # [K, N]
    z = _nibble(qzeros[:, torch.arange(n) // 8], torch.arange(n) % 8) + 1  # [G, N]
    g = t[f"{base}.g_idx"].long()
    return ((q - z[g]) * scales[g]).t()


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_int4_loader_matches_reference_dequantization(int4_ckpt, arch, method):
    folder = int4_ckpt(arch, method)
    tensors = load_file(str(folder / "model.safetensors"))
    reference = {"awq": reference_awq, "gptq": reference_gptq}[method]
    model = load_model(folder, dtype="float32", quantization=_resolved(folder))
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    layers = load_model_layers(folder)
    assert len(int4) == 4 * layers  # every decoder linear, nothing in the vision tower
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    for name, module in int4.items():
        layer = name.split(".")[2]
        pieces = [reference(tensors, f"{prefix}layers.{layer}.{PROJ[p]}") for p in OURS[name.rsplit(".", 1)[1]]]
        assert torch.equal(module.dequantized_weight(), torch.cat(pieces)), name
    assert not any(isinstance(m, Int4Linear) for m in model.visual.modules())


def load_model_layers(folder) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["num_hidden_layers"]


def _resolved(folder):
    from vlserve.model.hf_config import load_model_config
    from vlserve.model.quantization import resolve_quantization

    return resolve_quantization(None, load_model_config(folder).quantization)


# ---- engine end to end: the quantized engine computes what a dense model with its dequantized weights does --
def _dense_copy(model: torch.nn.Module, src, dst):
    """A full-precision checkpoint whose decoder linears hold `model`'s dequantized weights."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
               if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    for name, module in model.named_modules():
        if not isinstance(module, (Int4Linear, Int8Linear)):
            continue
        if name == "lm_head":
            tensors["lm_head.weight"] = module.dequantized_weight().contiguous()
            continue
        layer, ours = name.split(".")[2], name.rsplit(".", 1)[1]
        pieces = OURS[ours]
        weight = module.dequantized_weight()
        sizes = [weight.shape[0] // len(pieces)] * len(pieces)
        if ours == "qkv_proj":
            attn = model.get_submodule(name.rsplit(".", 1)[0])
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        for piece, w in zip(pieces, weight.split(sizes)):
            tensors[f"{prefix}layers.{layer}.{PROJ[piece]}.weight"] = w.contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("method", ["int8", "awq", "gptq"])
def test_quantized_engine_matches_its_dequantized_weights(tiny_ckpt, int4_ckpt, tmp_path, method, weight_only_int8):
    """Pictures and text batched, prefill (dense path) and decode (kernel path); same greedy tokens as a dense
    fp32 engine holding the dequantized weights, and the pools are full afterwards. (int8 with its activations
    quantized for prefill, as it runs by default on CPU: tests/test_int8_gemm.py bounds how far it moves.)"""
    src = tiny_ckpt("qwen2_vl") if method == "int8" else int4_ckpt("qwen2_vl", method)
    extra = {"quantization": "int8"} if method == "int8" else {}
    llm = LLM(str(src), dtype="float32", num_kv_blocks=64, **extra)
    model = llm.engine.core.runner.model
    kinds = {type(m) for m in model.language_model.layers.modules()}
    assert (Int8Linear if method == "int8" else Int4Linear) in kinds and torch.nn.Linear not in kinds
    # int8 quantizes the LM head too (made at load time); int4 checkpoints keep theirs as stored
    assert isinstance(model.lm_head, Int8Linear) == (method == "int8")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_pool_full(llm)
    reference = LLM(str(_dense_copy(model, src, tmp_path / "dense")), dtype="float32", num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want


def test_int8_moe_keeps_routers_and_experts(tiny_ckpt):
    """Qwen3-VL-MoE: attention and dense linears go int8; routers and experts stay as loaded; pictures run."""
    llm = LLM(str(tiny_ckpt("qwen3_vl_moe")), dtype="float32", quantization="int8", num_kv_blocks=64)
    model = llm.engine.core.runner.model
    routers = [m.gate for m in model.modules() if type(m).__name__ == "SparseMoE"]
    assert routers and not any(isinstance(r, Int8Linear) for r in routers)  # plain (or oneDNN-packed) linears
    assert any(isinstance(m, Int8Linear) for m in model.language_model.layers.modules())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert_pool_full(llm)


def test_int8_stays_close_to_the_full_precision_model(tiny_ckpt):
    """Quantization error itself is small: every int8 weight within half a step of the original."""
    path = tiny_ckpt("qwen2_vl")
    dense = load_model(path, dtype="float32")
    from vlserve.model.quantization import QuantizationConfig

    quant = load_model(path, dtype="float32", quantization=QuantizationConfig("int8"))
    for name, m in quant.named_modules():
        if isinstance(m, Int8Linear):
            w = dense.get_submodule(name).weight
            assert (m.dequantized_weight() - w).abs().max() <= w.abs().amax(1).max() / 254 + 1e-6
    assert isinstance(quant.lm_head, Int8Linear)


def test_int8_lm_head_computes_the_logits_tied_or_not(tiny_ckpt, weight_only_int8):
    """The LM head goes int8 (a tied one as its own copy: the embedding table stays in full precision), and the
    logits are the hidden states times the dequantized head, on the kernel's rows and past them."""
    from vlserve.model.quantization import quantize_int8

    path = tiny_ckpt("qwen2_vl")
    for tied in (False, True):
        model = load_model(path, dtype="float32")
        embed = model.language_model.embed_tokens.weight.clone()
        head = embed if tied else model.lm_head.weight.detach().clone()
        if tied:
            model.lm_head = None  # what a checkpoint with tie_word_embeddings loads as
        assert quantize_int8(model) == 4 * len(model.language_model.layers) + 1
        assert isinstance(model.lm_head, Int8Linear)
        assert torch.equal(model.language_model.embed_tokens.weight, embed)
        w = model.lm_head.dequantized_weight()
        assert (w - head).abs().max() <= head.abs().amax(1).max() / 254 + 1e-6
        torch.manual_seed(0)
        for rows in (1, 40):  # the kernel, then the dense path
            hidden = torch.randn(rows, w.shape[1])
            with torch.inference_mode():
                torch.testing.assert_close(model.compute_logits(hidden), hidden @ w.t(), rtol=1e-4, atol=1e-4)


# ---- failure paths -------------------------------------------------------------------------------------------
def _with_quant_config(src, dst, qc: dict | None):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32, "version": "gemm"}, "4-bit awq only"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "'gemm' packing only"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
])
def test_unsupported_quantization_config_is_refused(int4_ckpt, tmp_path, qc, match):
    folder = _with_quant_config(int4_ckpt("qwen2_vl", "gptq"), tmp_path / "q", qc)
    with pytest.raises(ModelLoadError, match=match):
        LLM(folder, dtype="float32", num_kv_blocks=16)


def test_quantization_option_must_fit_the_checkpoint(tiny_ckpt, int4_ckpt):
    with pytest.raises(InvalidInputError, match="needs an AWQ checkpoint"):
        LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", quantization="awq", num_kv_blocks=16)
    with pytest.raises(InvalidInputError, match="checkpoint is awq-quantized"):
        LLM(str(int4_ckpt("qwen2_vl", "awq")), dtype="float32", quantization="int8", num_kv_blocks=16)
    with pytest.raises(InvalidInputError, match="unknown quantization"):
        LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", quantization="int3", num_kv_blocks=16)


def test_config_says_int4_but_weights_are_dense(tiny_ckpt, tmp_path):
    folder = _with_quant_config(tiny_ckpt("qwen2_vl"), tmp_path / "q",
                                {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(ModelLoadError, match="no '.qweight' tensors"):
        LLM(folder, dtype="float32", num_kv_blocks=16)


def test_act_order_g_idx_is_refused(int4_ckpt, tmp_path):
    src = int4_ckpt("qwen2_vl", "gptq")
    folder = tmp_path / "act-order"
    shutil.copytree(src, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    key = next(k for k in tensors if k.endswith(".g_idx"))
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="act-order"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)


def test_cli_refuses_an_unknown_quantization(tiny_ckpt, capsys):
    from vlserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(tiny_ckpt("qwen2_vl")), "--quantization", "int3"])
    assert exit_info.value.code == 2
    assert "int3" in capsys.readouterr().err


def test_load_model_reads_the_checkpoint_quantization_itself(int4_ckpt):
    model = load_model(int4_ckpt("qwen2_vl", "awq"), dtype="float32")  # no quantization argument
    assert any(isinstance(m, Int4Linear) for m in model.modules())


@pytest.mark.parametrize("method, article", [("awq", "an AWQ"), ("gptq", "a GPTQ")])
def test_asking_for_int4_on_a_dense_checkpoint_names_the_format_with_its_article(method, article):
    with pytest.raises(InvalidInputError) as e:
        resolve_quantization(method, ())
    assert str(e.value).startswith(f"quantization '{method}' needs {article} checkpoint, and this one has no "
                                   "quantization_config")


# ---- int4_export: user mistakes are one clear line, before anything is written ------------------------------
def test_fitting_group_sizes():
    assert fitting_group_sizes([64, 128]) == [32, 64]
    assert fitting_group_sizes([3584, 18944]) == [32, 64, 128, 256, 512]  # Qwen2-VL-7B: 128 fits
    assert fitting_group_sizes([96, 192]) == [32, 96]
    assert fitting_group_sizes([48, 64]) == []


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_export_with_a_group_size_too_big_for_the_model_says_which_fits(tiny_ckpt, tmp_path, method):
    # The tiny model's linears take 64 and 128 inputs: the default group size (128) cannot divide 64.
    dst = tmp_path / "out"
    with pytest.raises(InvalidInputError) as e:
        export_int4(tiny_ckpt("qwen2_vl"), dst, method)  # group_size 128, the default
    assert str(e.value) == ("--group-size 128 does not divide the input size 64 of model.layers.0.mlp.gate_proj; use "
                            "--group-size 64, which divides all of this checkpoint's input sizes (64, 128)")
    assert not dst.exists()  # refused before writing anything
    with pytest.raises(InvalidInputError, match=r"^--group-size 50: vlserve loads 4-bit checkpoints whose group size "
                                                r"is a positive multiple of 32; use --group-size 32, "):
        export_int4(tiny_ckpt("qwen2_vl"), dst, method, 50)
    with pytest.raises(InvalidInputError, match="^--group-size 0: .*; use --group-size 32, "):
        export_int4(tiny_ckpt("qwen2_vl"), dst, method, 0)
    assert not dst.exists()
    # The suggestion works: the checkpoint loads and runs.
    llm = LLM(str(export_int4(tiny_ckpt("qwen2_vl"), dst, method, 64)), dtype="float32", num_kv_blocks=16)
    assert len(llm.generate(["hi"], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def _fake_checkpoint(folder, shapes: dict[str, tuple[int, int]]) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"]}))
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("shapes, message", [
    ({"model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.mlp.down_proj.weight": (64, 48)},
     ("no --group-size fits this checkpoint: vlserve needs a multiple of 32 that divides every quantized linear's "
      "input size, and model.layers.0.mlp.down_proj takes 48 (input sizes here: 48, 64)")),
    ({"model.layers.0.self_attn.k_proj.weight": (60, 128)},
     ("model.layers.0.self_attn.k_proj has 60 output channels; 4-bit packing needs a multiple of 8, so no "
      "--group-size can make this checkpoint exportable")),
    ({"model.embed_tokens.weight": (100, 64)},
     ("found none of the decoder layers' linears to quantize (names like model.layers.0.self_attn.q_proj.weight); "
      "is this a Qwen-VL checkpoint?")),
])
def test_export_refuses_shapes_it_cannot_pack(tmp_path, shapes, message):
    src = _fake_checkpoint(tmp_path / "src", shapes)
    with pytest.raises(InvalidInputError) as e:
        export_int4(src, tmp_path / "dst", "awq")
    assert str(e.value) == message


def test_export_refuses_a_missing_or_quantized_source(tmp_path, int4_ckpt):
    with pytest.raises(InvalidInputError, match="is not a checkpoint folder"):
        export_int4(tmp_path / "nope", tmp_path / "dst")
    with pytest.raises(InvalidInputError, match=r"is already quantized \(awq\); export from the full-precision"):
        export_int4(int4_ckpt("qwen2_vl", "awq"), tmp_path / "dst", "awq", GROUP)
    with pytest.raises(InvalidInputError, match="method must be one of awq, gptq"):
        export_int4(tmp_path / "nope", tmp_path / "dst", "int3")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_export_cli_prints_one_line_and_exits_nonzero(tiny_ckpt, tmp_path, capsys, method):
    assert int4_export.main([str(tiny_ckpt("qwen2_vl")), str(tmp_path / "out"), "--method", method]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --group-size 128 does not divide the input size 64 of model.layers.0.mlp.gate_proj; use "
                   "--group-size 64, which divides all of this checkpoint's input sizes (64, 128)\n")


def test_export_module_entry_has_no_traceback(tiny_ckpt, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vlserve.tools.int4_export", str(tiny_ckpt("qwen2_vl")),
                           str(tmp_path / "out"), "--method", "gptq"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: --group-size 128 does not divide")
