"""Read an InternVL config.json (`InternVLForConditionalGeneration`, transformers' InternVL3 layout) into a
`ModelConfig`.

`vision_config` is InternViT (`internvl_vision`), `text_config` a Qwen2 decoder (InternVL3; other language models
are refused), the projector's fields at the top. Sub-configs saved by transformers 4.x list only what differs
from the defaults; the defaults (InternVL3-1B's tower, transformers' InternVLConfig) are filled in here.

What only this family reads goes into `ModelConfig.family_settings` (the keys below); the tower's shape into
`VisionConfig` (temporal_patch_size = spatial_merge_size = 1: a tile is a plain picture).
"""

from __future__ import annotations

import json
from pathlib import Path

from vlserve.core.errors import ModelLoadError
from vlserve.model.config_types import (
    ModelConfig,
    TextConfig,
    VisionConfig,
    eos_ids,
    quantization_items,
    token_id,
    transformers_major,
)

ARCHITECTURE = "InternVLForConditionalGeneration"

# family_settings keys
TILE_SIZE = "tile_size"  # the tower's square input side, in pixels (vision image_size)
SHUFFLE = "shuffle_factor"  # 1 / downsample_ratio: pixel shuffle folds SHUFFLE x SHUFFLE patches into one token
NORM_TYPE = "norm_type"  # "layer_norm" | "rms_norm" (the blocks' norms)
QK_NORM = "use_qk_norm"  # RMSNorm over the whole q and k (InternViT-6B)
FINAL_NORM = "final_layernorm"  # not use_mean_pooling: a LayerNorm after the last block
VISION_EPS = "layer_norm_eps"
ATTENTION_BIAS = "attention_bias"  # the tower's q/k/v biases
PROJECTOR_ACT = "projector_hidden_act"

ACTIVATIONS = ("gelu", "silu", "quick_gelu", "gelu_pytorch_tanh")  # vlserve.model.layers.mlp's
VISION_DEFAULTS = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                   "hidden_act": "gelu", "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "image_size": 448,
                   "patch_size": 14, "num_channels": 3, "use_qk_norm": False, "attention_bias": False,
                   "use_mean_pooling": True, "use_absolute_position_embeddings": True}
TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "hidden_act": "silu"}
IMAGE_TOKEN = 151667  # <IMG_CONTEXT> in InternVL3's tokenizer
START_TOKEN, END_TOKEN, VIDEO_TOKEN = "<img>", "</img>", "<video>"  # InternVL3's tokenizer's


def _int(d: dict, key: str, where: str, minimum: int = 1) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json: {where} '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _side(v: dict, key: str) -> int:
    """image_size / patch_size: an int or a square [h, w]."""
    value = v.get(key)
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelLoadError(f"config.json: vision config '{key}' {value!r} is not square")
        value = value[0]
    return _int({key: value}, key, "vision config")


def _text(raw: dict) -> TextConfig:
    given = raw.get("text_config") or {}
    kind = given.get("model_type", "qwen2")
    if kind != "qwen2":
        raise ModelLoadError(f"InternVL with a {kind!r} language model is not supported (qwen2: InternVL3)")
    t = TEXT_DEFAULTS | given
    if t.get("use_sliding_window"):
        raise ModelLoadError("a Qwen2 language model with sliding-window attention is not supported")
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(f"RoPE scaling {rope!r} is not supported for InternVL (default RoPE only)")
    if t["hidden_act"] not in ACTIVATIONS:
        raise ModelLoadError(f"text hidden_act {t['hidden_act']!r} is not supported ({', '.join(ACTIVATIONS)})")
    hidden, heads = _int(t, "hidden_size", "text config"), _int(t, "num_attention_heads", "text config")
    kv_heads = t.get("num_key_value_heads") or heads
    if hidden % heads or heads % kv_heads:
        raise ModelLoadError(f"text config: {hidden} wide with {heads} heads and {kv_heads} kv heads is not served")
    head_dim = hidden // heads
    return TextConfig(
        vocab_size=_int(t, "vocab_size", "text config"), hidden_size=hidden,
        intermediate_size=_int(t, "intermediate_size", "text config"),
        num_layers=_int(t, "num_hidden_layers", "text config"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=float(t["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 1000000.0))),
        rotary_sections=(head_dim // 2, 0, 0),  # 1-D RoPE: every frequency follows the one position row
        max_position_embeddings=int(t["max_position_embeddings"]),
        # transformers ties InternVL's head by the top-level flag (InternVLConfig's default: tied)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), qkv_bias=True, hidden_act=t["hidden_act"])


def _vision(raw: dict, text: TextConfig) -> tuple[VisionConfig, dict]:
    v = VISION_DEFAULTS | (raw.get("vision_config") or {})
    width, heads = _int(v, "hidden_size", "vision config"), _int(v, "num_attention_heads", "vision config")
    tile, patch = _side(v, "image_size"), _side(v, "patch_size")
    ratio = raw.get("downsample_ratio", 0.5)
    shuffle = round(1 / ratio) if isinstance(ratio, (int, float)) and 0 < ratio <= 1 else 0
    side = tile // patch
    if width % heads or tile % patch or shuffle < 1 or abs(shuffle * ratio - 1) > 1e-9 or side % shuffle:
        raise ModelLoadError(f"vision tower: hidden_size {width} must divide into {heads} heads, image_size {tile} "
                             f"into patches of {patch}, and its {side} patches a side by 1 / downsample_ratio "
                             f"({ratio!r})")
    for where, act in (("vision hidden_act", v["hidden_act"]),
                       ("projector_hidden_act", raw.get("projector_hidden_act", "gelu"))):
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"{where} {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if v["norm_type"] not in ("layer_norm", "rms_norm"):
        raise ModelLoadError(f"vision norm_type {v['norm_type']!r} is not supported (layer_norm, rms_norm)")
    if not v["use_absolute_position_embeddings"] or v.get("use_mask_token"):
        raise ModelLoadError("an InternViT without absolute position embeddings, or with a mask token, is not served")
    # InternVL reads the last block's output (after the final norm) without its class row, as InternVL3 does
    layer = raw.get("vision_feature_layer", -1)
    select = raw.get("vision_feature_select_strategy", "default")
    if layer != -1 or select != "default":
        raise ModelLoadError(f"vision_feature_layer {layer!r} / vision_feature_select_strategy {select!r} are not "
                             f"supported (-1 / 'default', as InternVL3 ships)")
    vision = VisionConfig(
        depth=_int(v, "num_hidden_layers", "vision config"), width=width, num_heads=heads,
        mlp_hidden=_int(v, "intermediate_size", "vision config"), hidden_act=v["hidden_act"],
        out_dim=text.hidden_size, patch_size=patch, temporal_patch_size=1, spatial_merge_size=1,
        in_channels=_int(v, "num_channels", "vision config"), rope_theta=0.0, window_size=0,
        fullatt_block_indexes=(), tokens_per_second=0.0)
    settings = {TILE_SIZE: tile, SHUFFLE: shuffle, NORM_TYPE: v["norm_type"], QK_NORM: bool(v["use_qk_norm"]),
                FINAL_NORM: not v["use_mean_pooling"], VISION_EPS: float(v["layer_norm_eps"]),
                ATTENTION_BIAS: bool(v["attention_bias"]), PROJECTOR_ACT: raw.get("projector_hidden_act", "gelu")}
    return vision, settings


def special_tokens(folder: Path) -> dict[str, int]:
    """The tokenizer's added tokens by content (tokenizer.json), {} when it has none there: the ids of
    <img>, </img> and <video>, which config.json does not hold."""
    path = folder / "tokenizer.json"
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    except (OSError, ValueError, AttributeError):
        return {}
    return {t["content"]: t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)}


def parse_internvl_config(raw: dict, folder: Path, architecture: str) -> ModelConfig:
    text = _text(raw)
    vision, settings = _vision(raw, text)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    image_token = token_id(raw, "image_token_id", "image_token_index", default=IMAGE_TOKEN)
    added = special_tokens(folder)
    return ModelConfig(
        architecture=architecture,
        text=text,
        vision=vision,
        image_token_id=image_token,
        # the chat template's <video> (the processor lays each frame out as a picture); <img> and </img> around
        # every picture and frame; -1 where the tokenizer has no such token
        video_token_id=added.get(VIDEO_TOKEN, -1),
        vision_start_token_id=added.get(START_TOKEN, -1),
        vision_end_token_id=added.get(END_TOKEN, -1),
        eos_token_ids=eos_ids(raw, folder),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        transformers_major=transformers_major(raw),
        quantization=quantization_items(raw),
        position_kind="rope",
        video_rules="internvl",
        family_settings=tuple(sorted(settings.items())),
    )


def tile_tokens(cfg: ModelConfig) -> int:
    """Embedding rows one tile makes: its patches folded SHUFFLE x SHUFFLE by the pixel shuffle."""
    side = int(cfg.setting(TILE_SIZE)) // cfg.vision.patch_size // int(cfg.setting(SHUFFLE))
    return side * side
