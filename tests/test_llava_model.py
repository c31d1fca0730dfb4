"""The LLaVA family's model side (LLaVA-OneVision: SigLIP + Qwen2; LLaVA-NeXT-Video: CLIP + Llama) against
transformers 5, fp32, on tiny random checkpoints.

Configs parse (the tiny ones, the hub's sparse released ones, refusals of what is not served) and cross processes
unchanged; anyres.py's token counts equal transformers' processors' for many picture sizes at the released and
the tiny geometry; the tower's rows for a picture (transformers' own pixel values: tall, wide, square, tiny, big
enough for OneVision's anyres_max_9 downscale), a base-tile-only picture (OneVision's multi-image prompts) and a
video equal what transformers scatters into its inputs_embeds; the LM's logits equal transformers' (Llama also
with biases, its own head_dim and llama3 / linear RoPE scaling); every checkpoint tensor lands; the tower is whole
on every tensor-parallel rank; the engine's item check refuses what does not add up.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    LlavaNextVideoConfig,
    LlavaNextVideoForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
)
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_next_video.processing_llava_next_video import LlavaNextVideoProcessor
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.core.prompt import MultiModalItem
from vlserve.model.config_types import ModelConfig, RopeScaling
from vlserve.model.families.llava.anyres import Geometry
from vlserve.model.families.llava.checks import check_item, item_tokens
from vlserve.model.families.llava.config import LLAVA_NEXT_VIDEO, LLAVA_ONEVISION
from vlserve.model.hf_config import load_model_config, parse_model_config
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span
from vlserve.model.layers.parallel import TPGroup
from vlserve.model.loader import load_model

HF = {"llava_onevision": LlavaOnevisionForConditionalGeneration,
      "llava_next_video": LlavaNextVideoForConditionalGeneration}
PICTURE_PROCESSORS = {"llava_onevision": LlavaOnevisionImageProcessorPil,
                      "llava_next_video": LlavaNextImageProcessorPil}
# (height, width): wide, tall, square, tiny, big (OneVision: 4 x 4 tiles, downscaled), in between
SIZES = [(30, 200), (200, 30), (56, 56), (9, 13), (300, 280), (224, 224), (100, 170)]


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    """arch -> (folder, transformers model, our model), made once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = Path(tiny_ckpt(arch))
            made[arch] = path, HF[arch].from_pretrained(path, dtype=torch.float32).eval(), _ours(path)
        return made[arch]

    return get


def _ours(path: Path, **kw):
    return load_model(Path(path), dtype="float32", **kw)


def _picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# ---- configs ---------------------------------------------------------------------------------------------------
def test_tiny_configs(tiny_ckpt):
    ov = load_model_config(tiny_ckpt("llava_onevision"))
    assert (ov.family, ov.position_kind, ov.video_rules) == ("llava", "rope", "llava_onevision")
    assert ov.text.rotary_sections == (ov.text.head_dim // 2, 0, 0) and ov.text.qkv_bias
    assert ov.vision.side_row_layers == () and ov.side_rows == 0
    assert ov.setting("vision_model") == "siglip" and ov.setting("vision_feature_layers") == (ov.vision.depth,)
    assert (ov.setting("max_tiles"), ov.setting("video_pool"), ov.setting("video_newline")) == (9, "bilinear", True)
    nv = load_model_config(tiny_ckpt("llava_next_video"))
    assert nv.setting("vision_model") == "clip" and nv.setting("vision_feature_layers") == (nv.vision.depth - 1,)
    assert (nv.setting("max_tiles"), nv.setting("video_pool"), nv.setting("video_newline")) == (0, "average", False)
    assert not nv.text.qkv_bias and nv.text.rms_norm_eps == 1e-5 and nv.setting("text_model") == "llama"
    for cfg in (ov, nv):  # the config crosses processes as a typed message
        assert msgspec.json.decode(msgspec.json.encode(cfg), type=ModelConfig) == cfg


# The released checkpoints' config.json (transformers 4.x): sub-configs list what differs from the defaults.
RELEASED_ONEVISION = {
    "architectures": [LLAVA_ONEVISION], "model_type": "llava_onevision", "image_token_index": 151646,
    "video_token_index": 151647, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9", "torch_dtype": "float16",
    "image_grid_pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
    "text_config": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                    "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
                    "max_position_embeddings": 32768, "tie_word_embeddings": True, "vocab_size": 152000,
                    "eos_token_id": 151645},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 384,
                      "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 26,
                      "patch_size": 14, "vision_use_head": False},
}
RELEASED_NEXT_VIDEO = {
    "architectures": [LLAVA_NEXT_VIDEO], "model_type": "llava_next_video", "image_token_index": 32001,
    "video_token_index": 32000, "projector_hidden_act": "gelu", "spatial_pool_mode": "average",
    "spatial_pool_stride": 2, "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064,
    "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                    "vocab_size": 32064, "pad_token_id": 0},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                      "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768},
}


def test_released_configs_take_transformers_defaults(tmp_path):
    ov = parse_model_config(RELEASED_ONEVISION, tmp_path)
    assert ov.text.tie_word_embeddings  # the text config's flag is read (transformers forwards it)
    assert (ov.text.rms_norm_eps, ov.text.head_dim, ov.text.rope_theta) == (1e-6, 64, 1e6)
    assert (ov.vision.hidden_act, ov.setting("vision_layer_norm_eps"), ov.vision.in_channels) == \
        ("gelu_pytorch_tanh", 1e-6, 3)
    assert ov.setting("vision_feature_layers") == (26,) and ov.checkpoint_dtype == "float16"
    assert (ov.image_token_id, ov.video_token_id, ov.eos_token_ids) == (151646, 151647, (151645,))
    geo = Geometry.of(ov)
    assert (geo.side, geo.video_rows(8)) == (27, 8 * 14 * 14 + 1)
    nv = parse_model_config(RELEASED_NEXT_VIDEO, tmp_path)
    t = nv.text
    assert (t.hidden_size, t.num_layers, t.num_kv_heads, t.head_dim, t.rope_theta, t.qkv_bias) == \
        (4096, 32, 32, 128, 10000.0, False)
    assert (nv.vision.hidden_act, nv.setting("vision_layer_norm_eps")) == ("quick_gelu", 1e-5)
    assert nv.setting("vision_feature_layers") == (23,) and Geometry.of(nv).video_rows(8) == 8 * 144


def test_rope_scaling_is_parsed(tmp_path):
    raw = json.loads(json.dumps(RELEASED_NEXT_VIDEO))
    raw["text_config"]["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert parse_model_config(raw, tmp_path).text.rope_scaling == RopeScaling("linear", 2.0)
    raw["text_config"]["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert parse_model_config(raw, tmp_path).text.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("change, words", [
    ({"vision_config": {"model_type": "dinov2"}}, "vision tower"),
    ({"text_config": {"model_type": "mistral"}}, "language model"),
    ({"text_config": {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}}, "yarn"),
    ({"text_config": {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}, "dynamic"),
    ({"spatial_pool_mode": "conv"}, "spatial_pool_mode"),
    ({"vision_feature_select_strategy": "full"}, "select_strategy"),
    ({"image_grid_pinpoints": [[336, 600]]}, "multiples"),
    ({"vision_feature_layer": -40}, "vision_feature_layer"),
])
def test_what_is_not_served_is_refused(tmp_path, change, words):
    with pytest.raises(ModelLoadError, match=words):
        parse_model_config(RELEASED_NEXT_VIDEO | change, tmp_path)


@pytest.mark.parametrize("change", [{"vision_aspect_ratio": "anyres"}, {"vision_feature_select_strategy": "default"}])
def test_onevision_refusals(tmp_path, change):
    with pytest.raises(ModelLoadError):
        parse_model_config(RELEASED_ONEVISION | change, tmp_path)


# ---- token counts ----------------------------------------------------------------------------------------------
def _hf_count(cls, cfg: ModelConfig, height: int, width: int) -> int:
    """transformers' processor count (its own `_get_number_of_features`), minus the CLS row of "default"."""
    proc = cls.__new__(cls)
    size, patch = cfg.setting("image_size"), cfg.setting("patch_size")
    pins = Geometry.of(cfg).pinpoints
    proc.image_processor = SimpleNamespace(image_grid_pinpoints=[list(p) for p in pins])
    proc.num_image_tokens, proc.vision_aspect_ratio = (size // patch) ** 2, "anyres_max_9"
    proc.patch_size, proc.num_additional_image_tokens = patch, 1
    default = cfg.setting("vision_feature_select_strategy") == "default"
    return proc._get_number_of_features(height, width, size, size) - default


def test_token_counts_equal_transformers_processors(tiny_ckpt, tmp_path):
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 3000, (300, 2))] + SIZES + [(1, 2999), (2999, 1)]
    configs = [(LlavaOnevisionProcessor, parse_model_config(RELEASED_ONEVISION, tmp_path)),
               (LlavaNextVideoProcessor, parse_model_config(RELEASED_NEXT_VIDEO, tmp_path)),
               (LlavaOnevisionProcessor, load_model_config(tiny_ckpt("llava_onevision"))),
               (LlavaNextVideoProcessor, load_model_config(tiny_ckpt("llava_next_video")))]
    for cls, cfg in configs:
        geo = Geometry.of(cfg)
        for h, w in sizes:
            assert item_tokens(cfg, (geo.num_tiles(h, w), h, w)) == _hf_count(cls, cfg, h, w), (cfg.architecture, h, w)
    nv = configs[1][1]  # NeXT-Video's processor: (h // patch) * (w // patch) // 4 rows a frame
    assert item_tokens(nv, (8, 0, 0)) == (336 // 14) ** 2 // 4 * 8


# ---- the tower against transformers ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_picture_rows_equal_transformers(pair, arch):
    path, hf, model = pair(arch)
    proc = PICTURE_PROCESSORS[arch].from_pretrained(path)
    geo = Geometry.of(model.cfg)
    downscaled = 0
    for k, (h, w) in enumerate(SIZES):
        out = proc(images=[_picture(h, w, k)], return_tensors="pt")
        pixels, sizes = out["pixel_values"], out["image_sizes"]
        tiles = pixels.shape[1]
        assert tiles == geo.num_tiles(h, w) and sizes[0].tolist() == [h, w]
        with torch.no_grad():
            expected = hf.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output[0]
            ours = model.encode_images(pixels[0].reshape(tiles, -1), [(tiles, h, w)])[0]
        assert ours.shape[0] == item_tokens(model.cfg, (tiles, h, w))
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        rows, cols = geo.tile_grid(h, w)
        downscaled += geo.packed_shape(h, w)[0] < rows * geo.side and geo.packed_shape(h, w)[1] < cols * geo.side
    assert downscaled or arch == "llava_next_video"  # OneVision's anyres_max_9 ran


def test_onevision_multi_picture_rows_equal_transformers(pair):
    """Pictures of a multi-picture prompt: the base tile only, and one newline row."""
    path, hf, model = pair("llava_onevision")
    proc = PICTURE_PROCESSORS["llava_onevision"].from_pretrained(path)
    out = proc(images=[_picture(40, 90, 1), _picture(120, 60, 2)], return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                                               batch_num_images=torch.tensor([2])).pooler_output
        grids = [(1, 40, 90), (1, 120, 60)]
        ours = model.encode_images(out["pixel_values"][:, 0].reshape(2, -1), grids)
    for o, e, g in zip(ours, expected, grids):
        assert o.shape[0] == item_tokens(model.cfg, g) == 16 + 1
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_video_rows_equal_transformers(pair, arch):
    _, hf, model = pair(arch)
    frames = torch.randn(1, 3, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    picture = torch.randn(2, 3 * 56 * 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf.model.get_video_features(pixel_values_videos=frames).pooler_output[0]
        # a video and a base-tile picture in one tower call
        ours = model.encode_images(torch.cat([frames[0].reshape(3, -1), picture[:1]]), [(3, 0, 0), (1, 50, 50)])
    assert ours[0].shape[0] == item_tokens(model.cfg, (3, 0, 0)) == (3 * 4 + 1 if arch == "llava_onevision" else 3 * 4)
    torch.testing.assert_close(ours[0], expected, rtol=1e-5, atol=1e-5)


def test_several_feature_layers_are_concatenated(tmp_path):
    """vision_feature_layer as a list: those hidden states side by side (the projector reads them all)."""
    config = json.loads(json.dumps(_tiny_llama_config()))
    config["vision_feature_layer"] = [1, -2]
    path = _save_hf(LlavaNextVideoConfig(**config), tmp_path / "layers")
    hf = LlavaNextVideoForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = _ours(path)
    assert model.cfg.setting("vision_feature_layers") == (1, 3)
    frames = torch.randn(1, 2, 3, 56, 56, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf.model.get_video_features(pixel_values_videos=frames).pooler_output[0]
        ours = model.encode_images(frames[0].reshape(2, -1), [(2, 0, 0)])[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_tile_side_not_a_multiple_of_the_patch(tmp_path):
    """SigLIP's 384 px tiles hold 27 patches of 14 px: the last 6 px are not read (here 62 px: 4 patches)."""
    pins = [[62, 62], [62, 124], [124, 62], [124, 124], [186, 62]]
    config = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 62, "patch_size": 14},
        image_grid_pinpoints=pins, image_token_index=1000, video_token_index=1001, initializer_range=0.15)
    torch.manual_seed(0)
    LlavaOnevisionForConditionalGeneration(config).save_pretrained(str(tmp_path))
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = _ours(tmp_path)
    proc = LlavaOnevisionImageProcessorPil(size={"height": 62, "width": 62}, image_grid_pinpoints=pins,
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for k, (h, w) in enumerate([(40, 100), (170, 50)]):
        out = proc(images=[_picture(h, w, k)], return_tensors="pt")
        tiles = out["pixel_values"].shape[1]
        with torch.no_grad():
            expected = hf.model.get_image_features(**out).pooler_output[0]
            ours = model.encode_images(out["pixel_values"][0].reshape(tiles, -1), [(tiles, h, w)])[0]
        assert ours.shape[0] == item_tokens(model.cfg, (tiles, h, w))
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


# ---- the language model ----------------------------------------------------------------------------------------
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """One causal prefill over the whole sequence (fresh KV cache), 1-D RoPE as three equal rows."""
    t, n = model.cfg.text, ids.shape[0]
    heads = model.language_model.layers[0].self_attn.num_kv_heads
    caches = [torch.zeros(2, n, heads, t.head_dim) for _ in range(t.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[build_prefill_span(0, n, n, None)])
    with torch.no_grad():
        return model.compute_logits(model(model.embed_tokens(ids), torch.arange(n).expand(3, n), caches, meta))


IDS = torch.tensor([5, 17, 99, 3, 250, 7, 7, 640, 12, 1, 900, 31] * 3)


@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_text_logits_equal_transformers(pair, arch):
    _, hf, model = pair(arch)
    with torch.no_grad():
        expected = hf(input_ids=IDS[None]).logits[0]
    torch.testing.assert_close(_logits(model, IDS), expected, rtol=1e-4, atol=1e-4)


def _tiny_llama_config() -> dict:
    from vlserve.model.families.llava.tiny import NEXT_VIDEO_PINPOINTS

    return {"text_config": {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "initializer_range": 0.15},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 4, "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
            "image_grid_pinpoints": NEXT_VIDEO_PINPOINTS, "image_token_index": 1000, "video_token_index": 1001}


def _save_hf(config, path: Path) -> Path:
    torch.manual_seed(0)
    LlavaNextVideoForConditionalGeneration(config).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "factor": 3.0}])
def test_llama_variants_equal_transformers(tmp_path, rope):
    """Llama with attention_bias and mlp_bias, a head_dim of its own and scaled RoPE (short original context, so
    llama3's three frequency bands all occur)."""
    config = _tiny_llama_config()
    config["text_config"] |= {"attention_bias": True, "mlp_bias": True, "head_dim": 32,
                              "rope_parameters": {"rope_theta": 10000.0, **rope}}
    path = _save_hf(LlavaNextVideoConfig(**config), tmp_path / rope["rope_type"])
    hf = LlavaNextVideoForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the biases are zeros at init: give them values
        for name, p in hf.named_parameters():
            if name.endswith("bias") and "language_model" in name:
                p.normal_(0, 0.1)
    hf.save_pretrained(str(path))
    model = _ours(path)
    assert model.cfg.text.head_dim == 32 and model.cfg.text.rope_scaling.kind == rope["rope_type"]
    with torch.no_grad():
        expected = hf(input_ids=IDS[None]).logits[0]
    torch.testing.assert_close(_logits(model, IDS), expected, rtol=1e-4, atol=1e-4)


# ---- loading, tensor parallelism, item checks ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_every_checkpoint_tensor_lands(tiny_ckpt, arch, caplog):
    with caplog.at_level(logging.WARNING, logger="vlserve.model.loader"):
        model = _ours(tiny_ckpt(arch))
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]
    assert model.visual.patch_embed.proj.weight.dtype == torch.float32  # what the data-parallel encoder reads
    towers = _ours(tiny_ckpt(arch), with_language=False)
    assert towers.language_model is None and towers.visual is not None
    lm = _ours(tiny_ckpt(arch), with_vision=False)
    assert lm.visual is None and lm.language_model is not None


def test_hub_layout_names_land_too(tiny_ckpt, tmp_path):
    """Released checkpoints' names (`vision_tower.vision_model.*`), and transformers 5's `model.*` ones."""
    from safetensors.torch import load_file, save_file

    layouts = {"hub": [("vision_tower.", "vision_tower.vision_model.")],
               "v5": [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                      ("vision_tower.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector."),
                      ("image_newline", "model.image_newline")]}
    src = Path(tiny_ckpt("llava_next_video"))
    tensors = load_file(str(src / "model.safetensors"))
    expected = _logits(_ours(src), IDS)
    for name, renames in layouts.items():
        def rename(key: str) -> str:
            old, new = next(((o, n) for o, n in renames if key.startswith(o)), ("", ""))
            return new + key[len(old):]

        folder = tmp_path / name
        shutil.copytree(src, folder)
        save_file({rename(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"))
        model = _ours(folder)
        torch.testing.assert_close(_logits(model, IDS), expected)
        pixels = torch.randn(2, 3 * 56 * 56)
        with torch.no_grad():
            torch.testing.assert_close(model.encode_images(pixels, [(2, 0, 0)])[0],
                                       _ours(src).encode_images(pixels, [(2, 0, 0)])[0])


@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_tower_is_whole_on_every_rank(tiny_ckpt, arch):
    """Under tensor parallelism the LM is split, the tower whole, and it runs with no collective (rank 1 of 2, no
    process group: a collective would fail)."""
    path = tiny_ckpt(arch)
    whole, rank1 = _ours(path), _ours(path, tp=TPGroup(rank=1, size=2))
    widths = [m.language_model.layers[0].mlp.down_proj.weight.shape[1] for m in (whole, rank1)]
    assert widths[0] == 2 * widths[1]
    for (name, a), (_, b) in zip(whole.visual.named_parameters(), rank1.visual.named_parameters()):
        assert torch.equal(a, b), name
    grid = (Geometry.of(whole.cfg).num_tiles(30, 200), 30, 200)
    pixels = torch.randn(grid[0], 3 * 56 * 56)
    with torch.no_grad():
        torch.testing.assert_close(rank1.encode_images(pixels, [grid])[0], whole.encode_images(pixels, [grid])[0])


def test_item_check(tiny_ckpt):
    cfg = load_model_config(tiny_ckpt("llava_onevision"))
    row = 3 * 56 * 56

    def item(grid, tokens=None, rows=None, modality="image"):
        pixels = torch.zeros(grid[0] if rows is None else rows, row)
        return MultiModalItem(0, item_tokens(cfg, grid) if tokens is None else tokens, pixels, grid,
                              modality=modality)

    for grid, modality in (((5, 30, 200), "image"), ((1, 30, 200), "image"), ((4, 0, 0), "video")):
        check_item(item(grid, modality=modality), cfg)
    bad = [item((5, 30, 200), tokens=49), item((4, 30, 200), tokens=40), item((5, 30, 200), rows=4),
           item((4, 0, 0), modality="image", tokens=10), item((4, 2, 0), modality="video", tokens=10),
           item((0, 0, 0), modality="video", tokens=1), item((1, 30, 200), modality="audio"),
           item((5, -30, 200), tokens=3)]
    for it in bad:
        with pytest.raises(InvalidInputError):
            check_item(it, cfg)


def test_cpu_runs_the_encoder_in_chunks_of_tiles(pair, monkeypatch):
    from vlserve.model.families.llava import model as llava_model

    _, _, model = pair("llava_onevision")
    grids = [(17, 300, 280), (3, 0, 0), (1, 20, 20)]
    pixels = torch.randn(21, 3 * 56 * 56)
    with torch.no_grad():
        whole = model.encode_images(pixels, grids)
        monkeypatch.setattr(llava_model, "CPU_PATCHES_PER_CALL", 40)  # two tiles a call
        chunked = model.encode_images(pixels, grids)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)
