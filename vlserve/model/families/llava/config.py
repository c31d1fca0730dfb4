"""Read a LLaVA-OneVision or LLaVA-NeXT-Video config.json into a `ModelConfig`.

Both nest their parts: `vision_config` (SigLIP or CLIP), `text_config` (Qwen2 or Llama), the LLaVA fields at the
top. Sub-configs on the hub list only what differs from transformers' defaults (llava-hf checkpoints saved by
transformers 4.x: `rope_theta` / `rope_scaling` at the text config's top level), transformers 5 writes them
whole (`rope_parameters`); both are read, with the defaults filled in here.

What only this family reads goes into `ModelConfig.family_settings` (names: anyres.py's geometry keys and the
ones below); the vision tower's shape into `VisionConfig` (temporal_patch_size = spatial_merge_size = 1: a
tile's patches are its tokens).
"""

from __future__ import annotations

import re
from pathlib import Path

from vlserve.core.errors import ModelLoadError
from vlserve.model.config_types import (
    ModelConfig,
    RopeScaling,
    TextConfig,
    VisionConfig,
    eos_ids,
    quantization_items,
    token_id,
    transformers_major,
)
from vlserve.model.families.llava import anyres

LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"
LLAVA_NEXT_VIDEO = "LlavaNextVideoForConditionalGeneration"
ARCHITECTURES = (LLAVA_ONEVISION, LLAVA_NEXT_VIDEO)

# family_settings keys beside anyres.SETTINGS
VISION_MODEL = "vision_model"  # "siglip" | "clip"
FEATURE_LAYERS = "vision_feature_layers"  # hidden_states indices (0 = embeddings), concatenated in this order
FEATURE_SELECT = "vision_feature_select_strategy"  # "default": the CLS row dropped; "full": all rows
VISION_EPS = "vision_layer_norm_eps"
PROJECTOR_ACT = "projector_hidden_act"
PROJECTOR_BIAS = "multimodal_projector_bias"
TEXT_MODEL = "text_model"  # "qwen2" | "llama"
MLP_BIAS = "mlp_bias"  # Llama's gate/up/down biases (its attention_bias is TextConfig.qkv_bias, o_proj's too)

ACTIVATIONS = ("gelu", "silu", "quick_gelu", "gelu_pytorch_tanh")  # vlserve.model.layers.mlp's
# transformers' defaults for what hub sub-configs leave out
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}
CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5}
VISION_TYPES = {"siglip_vision_model": ("siglip", SIGLIP_DEFAULTS), "clip_vision_model": ("clip", CLIP_DEFAULTS)}
QWEN2_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "rope_theta": 10000.0, "hidden_act": "silu"}
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                  "rope_theta": 10000.0, "hidden_act": "silu"}
# per architecture: the defaults of LlavaOnevisionConfig / LlavaNextVideoConfig
ARCH_DEFAULTS = {
    LLAVA_ONEVISION: {
        "vision": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                   "patch_size": 14, "image_size": 384, "num_hidden_layers": 26, "num_attention_heads": 16},
        "text_type": "qwen2", "image_token": 151646, "video_token": 151647, "select": "full", "layer": -1,
        "pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
    },
    LLAVA_NEXT_VIDEO: {
        "vision": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                   "patch_size": 14, "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16},
        "text_type": "llama", "image_token": 32001, "video_token": 32000, "select": "default", "layer": -2,
        "pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    },
}


def _int(d: dict, key: str, where: str, minimum: int = 1) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json: {where} '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _rope(t: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older)."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ModelLoadError(f"RoPE type {kind!r} is not supported (default, linear, llama3)")
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelLoadError(f"RoPE {kind} scaling needs a positive 'factor', got {factor!r}")
    if kind == "linear":
        return theta, RopeScaling("linear", float(factor))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = rope.get("original_max_position_embeddings", t.get("max_position_embeddings", 8192))
    if not 0 < low < high or not isinstance(old, int) or old <= 0:
        raise ModelLoadError(f"RoPE llama3 scaling {rope!r}: needs 0 < low_freq_factor < high_freq_factor and a "
                             f"positive original_max_position_embeddings")
    return theta, RopeScaling("llama3", float(factor), low, high, old)


def _text_config(raw: dict, architecture: str) -> tuple[TextConfig, str, bool]:
    """(TextConfig, "qwen2" | "llama", mlp_bias)."""
    given = raw.get("text_config") or {}
    kind = given.get("model_type", ARCH_DEFAULTS[architecture]["text_type"])
    if kind not in ("qwen2", "llama"):
        raise ModelLoadError(f"{architecture} with a {kind!r} language model is not supported (qwen2, llama)")
    t = (QWEN2_DEFAULTS if kind == "qwen2" else LLAMA_DEFAULTS) | given
    if kind == "qwen2" and t.get("use_sliding_window"):
        raise ModelLoadError("a Qwen2 language model with sliding-window attention is not supported")
    if kind == "llama" and (t.get("pretraining_tp") or 1) != 1:
        raise ModelLoadError("a Llama language model with pretraining_tp != 1 is not supported")
    hidden = _int(t, "hidden_size", "text config")
    heads = _int(t, "num_attention_heads", "text config")
    # Qwen2 derives head_dim from hidden/heads; Llama may state it
    head_dim = (t.get("head_dim") or hidden // heads) if kind == "llama" else hidden // heads
    theta, scaling = _rope(t)
    if t.get("hidden_act", "silu") not in ACTIVATIONS:
        raise ModelLoadError(f"text hidden_act {t.get('hidden_act')!r} is not supported ({', '.join(ACTIVATIONS)})")
    # transformers reads the tie flag of either level (the LLaVA config forwards the text config's)
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(given.get("tie_word_embeddings", False))
    attention_bias = True if kind == "qwen2" else bool(t.get("attention_bias", False))
    text = TextConfig(
        vocab_size=_int(t, "vocab_size", "text config"),
        hidden_size=hidden,
        intermediate_size=_int(t, "intermediate_size", "text config"),
        num_layers=_int(t, "num_hidden_layers", "text config"),
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_sections=(head_dim // 2, 0, 0),  # 1-D RoPE: every frequency follows the one position row
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        tie_word_embeddings=tie,
        qkv_bias=attention_bias,  # Qwen2: q/k/v only; Llama's attention_bias: o_proj's too
        hidden_act=t.get("hidden_act", "silu"),
        rope_scaling=scaling,
    )
    if text.num_heads % text.num_kv_heads:
        raise ModelLoadError(f"{text.num_heads} attention heads are not a multiple of {text.num_kv_heads} kv heads")
    return text, kind, kind == "llama" and bool(t.get("mlp_bias", False))


def _feature_layers(raw: dict, architecture: str, depth: int) -> tuple[int, ...]:
    """`vision_feature_layer` (an int or a list) as indices into transformers' hidden_states (0: the embeddings,
    i: after block i; negative ones count from the end: -1 is the last block's output)."""
    layer = raw.get("vision_feature_layer", ARCH_DEFAULTS[architecture]["layer"])
    layers = [layer] if isinstance(layer, int) and not isinstance(layer, bool) else layer
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ModelLoadError(f"vision_feature_layer must be an integer or a list of them, got {layer!r}")
    out = tuple(i if i >= 0 else depth + 1 + i for i in layers)
    if not all(0 <= i <= depth for i in out):
        raise ModelLoadError(f"vision_feature_layer {layer!r} is outside the vision tower's {depth} layers")
    return out


def _pinpoints(raw: dict, architecture: str, image_size: int) -> tuple[int, ...]:
    pins = raw.get("image_grid_pinpoints") or ARCH_DEFAULTS[architecture]["pinpoints"]
    ok = isinstance(pins, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pins)
    if not ok or not all(isinstance(x, int) and x > 0 and x % image_size == 0 for p in pins for x in p):
        raise ModelLoadError(f"image_grid_pinpoints must be [height, width] pairs, multiples of the vision "
                             f"image_size {image_size}; got {pins!r}")
    return tuple(x for p in pins for x in p)


def _vision(raw: dict, architecture: str, text: TextConfig) -> tuple[VisionConfig, dict]:
    """(VisionConfig, the vision and projector settings)."""
    given = raw.get("vision_config") or ARCH_DEFAULTS[architecture]["vision"]
    kind = given.get("model_type", ARCH_DEFAULTS[architecture]["vision"]["model_type"])
    if kind not in VISION_TYPES:
        raise ModelLoadError(f"{architecture} with a {kind!r} vision tower is not supported "
                             f"({', '.join(VISION_TYPES)})")
    name, defaults = VISION_TYPES[kind]
    v = defaults | given
    width, heads = _int(v, "hidden_size", "vision config"), _int(v, "num_attention_heads", "vision config")
    image_size, patch = _int(v, "image_size", "vision config"), _int(v, "patch_size", "vision config")
    if width % heads or image_size < patch:  # 384 px tiles of 14 px patches: 27 a side, the last 6 px unread
        raise ModelLoadError(f"vision tower: hidden_size {width} must divide into {heads} heads and image_size "
                             f"{image_size} hold a patch of {patch}")
    for key, act in (("vision hidden_act", v["hidden_act"]), ("projector_hidden_act",
                                                              raw.get("projector_hidden_act", "gelu"))):
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"{key} {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    select = raw.get("vision_feature_select_strategy", ARCH_DEFAULTS[architecture]["select"])
    # Each tile must give n*n rows (the packing lays them on a grid): CLIP's CLS row dropped, SigLIP's all kept.
    if (name, select) not in (("clip", "default"), ("siglip", "full")):
        raise ModelLoadError(f"vision_feature_select_strategy {select!r} with a {name} tower is not supported "
                             f"(clip: 'default', siglip: 'full')")
    depth = _int(v, "num_hidden_layers", "vision config")
    vision = VisionConfig(
        depth=depth, width=width, num_heads=heads, mlp_hidden=_int(v, "intermediate_size", "vision config"),
        hidden_act=v["hidden_act"], out_dim=text.hidden_size, patch_size=patch, temporal_patch_size=1,
        spatial_merge_size=1, in_channels=_int(v, "num_channels", "vision config"), rope_theta=0.0, window_size=0,
        fullatt_block_indexes=(), tokens_per_second=0.0)
    settings = {
        VISION_MODEL: name,
        FEATURE_LAYERS: _feature_layers(raw, architecture, depth),
        FEATURE_SELECT: select,
        VISION_EPS: float(v["layer_norm_eps"]),
        PROJECTOR_ACT: raw.get("projector_hidden_act", "gelu"),
        PROJECTOR_BIAS: bool(raw.get("multimodal_projector_bias", True)),
        anyres.IMAGE_SIZE: image_size,
        anyres.PATCH_SIZE: patch,
        anyres.GRID_PINPOINTS: _pinpoints(raw, architecture, image_size),
    }
    return vision, settings


def _media_settings(raw: dict, architecture: str) -> dict:
    """OneVision: anyres_max_N downscaling, bilinear video pooling, a newline after a video; NeXT-Video: average
    (or max) pooling by spatial_pool_stride, no newline."""
    if architecture == LLAVA_ONEVISION:
        aspect = raw.get("vision_aspect_ratio", "anyres_max_9")
        match = re.fullmatch(r"anyres_max_(\d+)", str(aspect))
        if match is None or int(match[1]) <= 0:
            raise ModelLoadError(f"vision_aspect_ratio {aspect!r} is not supported (anyres_max_N)")
        return {anyres.MAX_TILES: int(match[1]), anyres.VIDEO_POOL: "bilinear", anyres.VIDEO_POOL_STRIDE: 2,
                anyres.VIDEO_NEWLINE: True}
    mode, stride = raw.get("spatial_pool_mode", "average"), raw.get("spatial_pool_stride", 2)
    if mode not in ("average", "max"):
        raise ModelLoadError(f"spatial_pool_mode {mode!r} is not supported (average, max)")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride <= 0:
        raise ModelLoadError(f"spatial_pool_stride must be a positive integer, got {stride!r}")
    return {anyres.MAX_TILES: 0, anyres.VIDEO_POOL: mode, anyres.VIDEO_POOL_STRIDE: stride,
            anyres.VIDEO_NEWLINE: False}


def parse_llava_config(raw: dict, folder: Path, architecture: str) -> ModelConfig:
    text, text_kind, mlp_bias = _text_config(raw, architecture)
    vision, settings = _vision(raw, architecture, text)
    settings |= _media_settings(raw, architecture) | {TEXT_MODEL: text_kind, MLP_BIAS: mlp_bias}
    side = settings[anyres.IMAGE_SIZE] // settings[anyres.PATCH_SIZE]
    if settings[anyres.VIDEO_POOL] != "bilinear" and side < settings[anyres.VIDEO_POOL_STRIDE]:
        raise ModelLoadError(f"spatial_pool_stride {settings[anyres.VIDEO_POOL_STRIDE]} exceeds a frame's "
                             f"{side} patches per side")
    dtype = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    defaults = ARCH_DEFAULTS[architecture]
    return ModelConfig(
        architecture=architecture,
        text=text,
        vision=vision,
        image_token_id=token_id(raw, "image_token_id", "image_token_index", default=defaults["image_token"]),
        video_token_id=token_id(raw, "video_token_id", "video_token_index", default=defaults["video_token"]),
        vision_start_token_id=-1,
        vision_end_token_id=-1,
        eos_token_ids=eos_ids(raw, folder),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        transformers_major=transformers_major(raw),
        quantization=quantization_items(raw),
        position_kind="rope",
        video_rules="llava_onevision" if architecture == LLAVA_ONEVISION else "llava_next_video",
        family_settings=tuple(sorted(settings.items())),
    )
