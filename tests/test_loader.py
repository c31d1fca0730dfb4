"""Checkpoint loading: key layouts, sharding, broken folders, hub ids, dtypes and config formats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ARCHES, IMG, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import ModelLoadError, UnsupportedModelError, VlserveError
from vlserve.model.hf_config import parse_model_config
from vlserve.model.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SUPPORTED = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


# ---- helpers ---------------------------------------------------------------------------------------------
def _clone_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _save(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name), metadata={"format": "pt"})


def _variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    _clone_without_weights(src, dst)
    _save(dst, tensors)
    return dst


def _to_transformers5_layout(name: str) -> str:
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name  # lm_head.*


def _write_sharded(src: Path, dst: Path, num_shards: int = 2) -> list[str]:
    _clone_without_weights(src, dst)
    tensors = _tensors(src)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {}
    for i, fname in enumerate(files):
        part = names[i::num_shards]  # interleaved: q/k/v pieces of one layer land in different files
        _save(dst, {k: tensors[k] for k in part}, fname)
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return files


def _prompts():
    return ["Hello, how are you?", {"prompt": f"Describe {IMG} please", "multi_modal_data": {"image": noise_image(80, 60, 7)}}]


def _greedy(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype=kw.pop("dtype", "float32"), num_kv_blocks=64, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=ARCHES)
def ref(request, tiny_ckpt):
    path = tiny_ckpt(request.param)
    return path, _greedy(path)


@pytest.fixture(scope="module")
def base(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


# ---- layouts and shards ----------------------------------------------------------------------------------
def test_tiny_checkpoint_uses_original_hub_layout(base):
    names = _tensors(base)
    assert any(k.startswith("model.layers.") for k in names)
    assert any(k.startswith("visual.") for k in names)
    assert not any(k.startswith("model.language_model.") for k in names)


def test_transformers5_layout_loads_identically(ref, tmp_path):
    path, expected = ref
    renamed = {_to_transformers5_layout(k): v for k, v in _tensors(path).items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    assert any(k.startswith("model.visual.") for k in renamed)
    new = _variant(path, tmp_path / "tf5", renamed)
    assert _greedy(new) == expected


def test_sharded_checkpoint_loads_identically(ref, tmp_path):
    path, expected = ref
    sharded = tmp_path / "sharded"
    _write_sharded(path, sharded)
    assert not (sharded / "model.safetensors").exists()
    assert _greedy(sharded) == expected


def test_missing_shard_is_named(base, tmp_path):
    sharded = tmp_path / "sharded"
    files = _write_sharded(base, sharded)
    (sharded / files[1]).unlink()
    with pytest.raises(ModelLoadError, match=files[1]):
        LLM(str(sharded), num_kv_blocks=16)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"metadata": {}})])
def test_corrupt_index_file(base, tmp_path, content):
    sharded = tmp_path / "sharded"
    _write_sharded(base, sharded)
    (sharded / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        LLM(str(sharded), num_kv_blocks=16)


# ---- broken folders --------------------------------------------------------------------------------------
def test_missing_config_json(base, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(base, folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(folder), num_kv_blocks=16)


def test_invalid_config_json(base, tmp_path):
    folder = tmp_path / "badjson"
    shutil.copytree(base, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        LLM(str(folder), num_kv_blocks=16)


def test_missing_weights(base, tmp_path):
    folder = _clone_without_weights(base, tmp_path / "noweights")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(folder), num_kv_blocks=16)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(base, tmp_path, damage):
    folder = tmp_path / damage
    shutil.copytree(base, folder)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    content = {"garbage": bytes(range(256)) * 40, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    f.write_bytes(content)
    with pytest.raises(ModelLoadError, match="model.safetensors") as e:
        LLM(str(folder), num_kv_blocks=16)
    assert "corrupt" in str(e.value) or "unreadable" in str(e.value)


@pytest.mark.parametrize("missing", ["tokenizer", "preprocessor_config.json"])
def test_missing_processing_files(base, tmp_path, missing):
    folder = tmp_path / "incomplete"
    shutil.copytree(base, folder)
    for f in folder.iterdir():
        if f.name.startswith(missing):
            f.unlink()
    with pytest.raises(ModelLoadError, match=missing):
        LLM(str(folder), num_kv_blocks=16)


def test_invalid_preprocessor_config(base, tmp_path):
    folder = tmp_path / "badproc"
    shutil.copytree(base, folder)
    (folder / "preprocessor_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        LLM(str(folder), num_kv_blocks=16)


def test_unsupported_architecture_lists_supported(base, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(folder), num_kv_blocks=16)
    assert isinstance(e.value, ModelLoadError)
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg
    for arch in SUPPORTED:
        assert arch in msg


def test_no_architectures_entry(base, tmp_path):
    folder = tmp_path / "noarch"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="architectures"):
        LLM(str(folder), num_kv_blocks=16)


@pytest.mark.parametrize("key", ["model.norm.weight", "model.layers.1.self_attn.k_proj.weight",
                                 "model.layers.0.mlp.up_proj.weight", "visual.merger.ln_q.bias"])
def test_missing_tensor_is_named(base, tmp_path, key):
    tensors = _tensors(base)
    del tensors[key]
    folder = _variant(base, tmp_path / "missing", tensors)
    with pytest.raises(ModelLoadError) as e:
        LLM(str(folder), num_kv_blocks=16)
    msg = str(e.value)
    # Named as our parameter: the prefix may differ and fused pieces carry their shard (qkv_proj...:k).
    stem = key.split(".", 1)[1] if key.startswith("model.") else key
    fused = {"k_proj": "qkv_proj", "up_proj": "gate_up_proj"}
    for piece, ours in fused.items():
        if piece in stem:
            stem = stem.replace(piece, ours)
            assert f":{piece.split('_')[0]}" in msg
    assert stem in msg, msg


@pytest.mark.parametrize("key,shape", [
    ("model.norm.weight", (32,)),
    ("lm_head.weight", (1024, 32)),
    ("visual.patch_embed.proj.weight", (32, 3, 2, 7, 7)),
    # fused pieces: fewer rows than the piece has must not land silently in the wrong rows of qkv / gate_up
    ("model.layers.0.self_attn.q_proj.weight", (32, 64)),
    ("model.layers.0.self_attn.k_proj.weight", (16, 64)),
    ("model.layers.0.self_attn.v_proj.bias", (64,)),
    ("model.layers.0.mlp.up_proj.weight", (64, 64)),
    ("model.layers.0.mlp.gate_proj.weight", (256, 64)),
    ("model.layers.0.self_attn.q_proj.weight", (256, 64)),
])
def test_wrong_shape(base, tmp_path, key, shape):
    tensors = _tensors(base)
    assert tensors[key].shape != shape
    tensors[key] = torch.zeros(shape)
    folder = _variant(base, tmp_path / "shape", tensors)
    with pytest.raises(ModelLoadError, match="shape") as e:
        LLM(str(folder), num_kv_blocks=16)
    assert key in str(e.value)


# ---- hub ids and odd paths -------------------------------------------------------------------------------
def test_uncached_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)  # read once at import: patch the constant too
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    model_id = "vlserve-tests/definitely-not-cached-model"
    with pytest.raises(ModelLoadError, match=model_id):
        LLM(model_id, num_kv_blocks=16)


@pytest.mark.parametrize("bad", ["/nonexistent/vlserve/model-dir", "./no-such-model", "not-a-model",
                                 "a/b/c/d", "~/no/such/folder/here"])
def test_nonsense_path(bad):
    with pytest.raises(ModelLoadError):
        LLM(bad, num_kv_blocks=16)


def test_file_instead_of_folder(base):
    with pytest.raises(ModelLoadError, match="not a folder"):
        LLM(str(base / "config.json"), num_kv_blocks=16)


# ---- dtypes ----------------------------------------------------------------------------------------------
def _param_dtypes(llm: LLM) -> set[torch.dtype]:
    return {p.dtype for p in llm.engine.core.runner.model.parameters()}


@pytest.mark.parametrize("dtype,expected", [("auto", torch.float32), ("float32", torch.float32),
                                            ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype(base, dtype, expected):
    llm = LLM(str(base), dtype=dtype, device="cpu", num_kv_blocks=16)
    assert llm.config.dtype == expected
    assert _param_dtypes(llm) == {expected}
    assert {kv.dtype for kv in llm.engine.core.runner.kv_caches} == {expected}
    out = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)


@pytest.mark.parametrize("bad", ["float64", "fp32", "int8", ""])
def test_bad_dtype(base, bad):
    with pytest.raises(VlserveError, match="dtype"):
        LLM(str(base), dtype=bad, num_kv_blocks=16)


def test_load_model_without_engine(base):
    model = load_model(base, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


# ---- config.json formats ---------------------------------------------------------------------------------
def _flat_config(nested: dict) -> dict:
    """The original hub format: text fields at the top level, rope_scaling / rope_theta instead of rope_parameters."""
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    for k, v in text.items():
        if k != "model_type":
            flat.setdefault(k, v)
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["rope_theta"] = rope["rope_theta"]
    flat["torch_dtype"] = flat.pop("dtype")
    return flat


@pytest.mark.parametrize("arch", ARCHES)
def test_flat_config_parses_like_nested(tiny_ckpt, arch):
    path = tiny_ckpt(arch)
    nested = json.loads((path / "config.json").read_text())
    flat = _flat_config(nested)
    assert "text_config" not in flat and "hidden_size" in flat and "rope_parameters" not in flat
    assert parse_model_config(flat, path) == parse_model_config(nested, path)


def test_flat_config_checkpoint_generates_identically(ref, tmp_path):
    path, expected = ref
    folder = tmp_path / "flat"
    shutil.copytree(path, folder)
    nested = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(_flat_config(nested)))
    assert _greedy(folder) == expected


def test_flat_config_rope_theta_is_read(base):
    nested = json.loads((base / "config.json").read_text())
    flat = _flat_config(nested)
    flat["rope_theta"] = 12345.0
    assert parse_model_config(flat, base).text.rope_theta == 12345.0
    nested["text_config"]["rope_parameters"]["rope_theta"] = 54321.0
    assert parse_model_config(nested, base).text.rope_theta == 54321.0


@pytest.mark.parametrize("flat", [False, True])
def test_bad_mrope_section(base, tmp_path, flat):
    raw = json.loads((base / "config.json").read_text())
    if flat:
        raw = _flat_config(raw)
        raw["rope_scaling"]["mrope_section"] = [2, 3, 4]
    else:
        raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ModelLoadError, match="mrope_section"):
        parse_model_config(raw, base)
    folder = tmp_path / "badrope"
    shutil.copytree(base, folder)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="mrope_section"):
        LLM(str(folder), num_kv_blocks=16)


def test_missing_required_text_field(base):
    raw = json.loads((base / "config.json").read_text())
    del raw["text_config"]["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        parse_model_config(raw, base)
