"""Read a Qwen family config.json (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), Qwen2-Audio,
Qwen2.5-Omni) into a `ModelConfig`.

Qwen2.5-Omni's thinker comes from a thinker-only checkpoint or the full one (`thinker_config`; the talker is not
served). Two formats exist in the wild and both are accepted:
- transformers >= 5 nests the language model under `text_config` and names RoPE settings `rope_parameters`;
- older checkpoints keep RoPE settings in `rope_scaling` + `rope_theta` (and Qwen2-VL's text fields at the top).
"""

from __future__ import annotations

from pathlib import Path

from vlserve.core.errors import ModelLoadError
from vlserve.model.config_types import (
    AudioConfig,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    TextConfig,
    VisionConfig,
    eos_ids,
    quantization_items,
    require,
    token_id,
    transformers_major,
)

QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                               "Qwen3VLForConditionalGeneration",
                                               "Qwen3VLMoeForConditionalGeneration")
QWEN3_FAMILY = (QWEN3_VL, QWEN3_VL_MOE)
# Qwen3.5: Qwen3-VL's vision tower without DeepStack, a hybrid decoder (Gated DeltaNet + gated full attention)
QWEN3_5, QWEN3_5_MOE = "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"
QWEN3_5_FAMILY = (QWEN3_5, QWEN3_5_MOE)
QWEN2_AUDIO = "Qwen2AudioForConditionalGeneration"
QWEN2_5_OMNI_THINKER, QWEN2_5_OMNI = "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration"
OMNI_FAMILY = (QWEN2_5_OMNI_THINKER, QWEN2_5_OMNI)
ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE, QWEN2_AUDIO, QWEN2_5_OMNI_THINKER,
                 QWEN2_5_OMNI)
# Names released checkpoints use for a class transformers later renamed: read as that class.
ARCHITECTURE_ALIASES = {"Qwen2_5OmniModel": QWEN2_5_OMNI}  # Qwen/Qwen2.5-Omni-* (the preview's class name)
# transformers' Qwen2Config defaults: Qwen2-Audio's config.json lists only what differs from them.
QWEN2_TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
                       "max_position_embeddings": 32768, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _rope(raw: dict, t: dict) -> dict:
    return t.get("rope_parameters") or t.get("rope_scaling") or raw.get("rope_scaling") or {}


def _text_config(raw: dict, architecture: str) -> TextConfig:
    t = raw.get("text_config") or raw  # nested (transformers 5) or flat (original hub format)
    rope = _rope(raw, t)
    qwen3, one_d = architecture in QWEN3_FAMILY, architecture == QWEN2_AUDIO
    if one_d:  # Qwen2-Audio: a plain Qwen2 LM, its config.json lists what differs from Qwen2Config's defaults
        t = QWEN2_TEXT_DEFAULTS | t
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(f"Qwen2-Audio with RoPE scaling {rope!r} is not supported (only default RoPE)")
        if t.get("use_sliding_window"):
            raise ModelLoadError("Qwen2-Audio with sliding-window attention is not supported")
    theta = rope.get("rope_theta", t.get("rope_theta", raw.get("rope_theta", 500000.0 if qwen3 else 1000000.0)))
    hidden = require(t, "hidden_size", "text config")
    heads = require(t, "num_attention_heads", "text config")
    # Qwen2-VL derives head_dim from hidden/heads (and ignores any `head_dim` key); Qwen3 states it.
    head_dim = (t.get("head_dim") or hidden // heads) if qwen3 else hidden // heads
    if one_d:  # every frequency follows the first row: 1-D RoPE, positions as one row (ModelConfig.position_rows)
        section = (head_dim // 2, 0, 0)
    else:
        section = tuple(rope.get("mrope_section", (24, 20, 20) if qwen3 else (16, 24, 24)))
    if sum(section) != head_dim // 2:
        raise ModelLoadError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    if one_d:  # transformers' Qwen2-Audio never ties its LM head (whatever text_config says)
        tie = False
    elif architecture in OMNI_FAMILY:  # the thinker's own flag decides (default: untied)
        tie = raw.get("tie_word_embeddings", False)
    else:
        tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    moe = _moe_config(t) if architecture == QWEN3_VL_MOE else None
    return TextConfig(
        vocab_size=require(t, "vocab_size", "text config"),
        hidden_size=hidden,
        intermediate_size=require(t, "intermediate_size", "text config"),
        num_layers=require(t, "num_hidden_layers", "text config"),
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rotary_sections=section,  # config.json's mrope_section
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(tie),
        qkv_bias=not qwen3 or bool(t.get("attention_bias", False)),
        rotary_interleaved=qwen3,  # transformers interleaves for Qwen3-VL whatever the config's flag says
        hidden_act=t.get("hidden_act", "silu"),
        moe=moe,
    )


def _moe_config(t: dict, shared: bool = False) -> MoEConfig:
    experts = t.get("num_experts", t.get("num_local_experts"))
    if experts is None:
        raise ModelLoadError("config.json: missing 'num_experts' in text config")
    moe = MoEConfig(num_experts=experts,
                    top_k=require(t, "num_experts_per_tok", "text config"),
                    intermediate_size=require(t, "moe_intermediate_size", "text config"),
                    # Qwen3.5-MoE (shared): every layer sparse, whatever the config says
                    sparse_step=1 if shared else t.get("decoder_sparse_step") or 1,
                    dense_layers=() if shared else tuple(t.get("mlp_only_layers") or ()),
                    shared_expert_intermediate_size=require(t, "shared_expert_intermediate_size", "text config")
                    if shared else 0)
    if not 0 < moe.top_k <= moe.num_experts:
        raise ModelLoadError(f"num_experts_per_tok {moe.top_k} must be within 1..num_experts {moe.num_experts}")
    return moe


def _qwen3_5_text_config(raw: dict, architecture: str) -> TextConfig:
    """Qwen3.5's hybrid decoder. What transformers 5 would compute differently from us is refused here."""
    t = require(raw, "text_config", "config.json")
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(f"Qwen3.5 with RoPE scaling {rope!r} is not supported (only default RoPE)")
    if t.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"Qwen3.5 with hidden_act {t['hidden_act']!r} is not supported (only silu)")
    if t.get("attn_output_gate", True) is not True:
        raise ModelLoadError("Qwen3.5 without the attention output gate (attn_output_gate false) is not supported")
    layers = require(t, "num_hidden_layers", "text config")
    types = t.get("layer_types")
    if types is None:
        interval = t.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ModelLoadError(f"full_attention_interval must be a positive integer, got {interval!r}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise ModelLoadError(f"layer_types must list 'full_attention' or 'linear_attention' for each of the "
                             f"{layers} layers, got {types!r}")
    hidden, heads = require(t, "hidden_size", "text config"), require(t, "num_attention_heads", "text config")
    head_dim = t.get("head_dim") or hidden // heads
    factor = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {factor} must make an even rotary size within head_dim "
                             f"{head_dim} (got {rotary_dim})")
    section = tuple(rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ModelLoadError(f"mrope_section {list(section)} must be 3 sizes summing to the rotary size / 2 = "
                             f"{rotary_dim // 2}")
    linear = LinearAttentionConfig(conv_kernel=t.get("linear_conv_kernel_dim", 4),
                                   num_key_heads=t.get("linear_num_key_heads", 16),
                                   num_value_heads=t.get("linear_num_value_heads", 32),
                                   key_head_dim=t.get("linear_key_head_dim", 128),
                                   value_head_dim=t.get("linear_value_head_dim", 128))
    if linear.conv_kernel < 2:
        raise ModelLoadError(f"linear_conv_kernel_dim {linear.conv_kernel} must be at least 2")
    if min(linear.num_key_heads, linear.num_value_heads) < 1 or linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(f"linear_num_value_heads {linear.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads {linear.num_key_heads}")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=require(t, "vocab_size", "text config"),
        hidden_size=hidden,
        intermediate_size=t.get("intermediate_size", 0) if architecture == QWEN3_5_MOE
        else require(t, "intermediate_size", "text config"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
        rotary_sections=section,  # config.json's mrope_section
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(tie),
        qkv_bias=bool(t.get("attention_bias", False)),
        rotary_interleaved=True,  # transformers interleaves for Qwen3.5 whatever the config's flag says
        moe=_moe_config(t, shared=True) if architecture == QWEN3_5_MOE else None,
        layer_types=tuple(types),
        linear_attention=linear,
        partial_rotary_factor=factor,
        attn_output_gate=True,
    )


def _vision_config(raw: dict, architecture: str, text: TextConfig) -> VisionConfig | None:
    if architecture == QWEN2_AUDIO:
        return None
    v = require(raw, "vision_config", "config.json")
    omni = architecture in OMNI_FAMILY
    windowed, qwen3 = architecture == QWEN2_5_VL or omni, architecture in QWEN3_FAMILY + QWEN3_5_FAMILY
    if windowed:  # Qwen2.5-VL and Omni: RMSNorm + SwiGLU blocks, window attention, explicit out_hidden_size
        width, mlp_hidden = v.get("hidden_size", 1280), v.get("intermediate_size", 3420)
        out_dim, act = v.get("out_hidden_size", text.hidden_size), v.get("hidden_act", "silu")
    elif qwen3:  # Qwen3-VL: LayerNorm + GELU(tanh) blocks, learned position grid, deepstack mergers
        width, mlp_hidden = v.get("hidden_size", 1152), v.get("intermediate_size", 4304)
        out_dim, act = v.get("out_hidden_size", text.hidden_size), v.get("hidden_act", "gelu_pytorch_tanh")
    else:  # Qwen2-VL: LayerNorm + GELU blocks; `hidden_size` is the merger's output width
        width = v.get("embed_dim", 1280)
        mlp_hidden = int(width * v.get("mlp_ratio", 4))
        out_dim, act = v.get("hidden_size", text.hidden_size), v.get("hidden_act", "quick_gelu")
    if out_dim != text.hidden_size:
        raise ModelLoadError(f"vision output width {out_dim} != language model hidden size {text.hidden_size}")
    rope = v.get("rope_parameters") or {}
    # Qwen3.5: no DeepStack (transformers ignores the key if a config has it)
    deepstack = tuple(v.get("deepstack_visual_indexes", (8, 16, 24))) if architecture in QWEN3_FAMILY else ()
    depth = v.get("depth", 27 if qwen3 else 32)
    if any(not 0 <= i < depth for i in deepstack) or len(set(deepstack)) != len(deepstack):
        raise ModelLoadError(f"deepstack_visual_indexes {list(deepstack)} must be distinct blocks of 0..{depth - 1}")
    grid = v.get("num_position_embeddings", 2304) if qwen3 else 0
    if qwen3 and int(grid**0.5) ** 2 != grid:
        raise ModelLoadError(f"num_position_embeddings {grid} must be a square (a grid of positions)")
    return VisionConfig(
        depth=depth,
        width=width,
        num_heads=v.get("num_heads", 16),
        mlp_hidden=mlp_hidden,
        hidden_act=act,
        out_dim=out_dim,
        patch_size=v.get("patch_size", 16 if qwen3 else 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=v.get("window_size", 112) if windowed else 0,
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if windowed else (),
        # Omni spaces video frames by the thinker's position_id_per_seconds, as Qwen2.5-VL by tokens_per_second
        tokens_per_second=float(raw.get("position_id_per_seconds", 25) if omni else v.get("tokens_per_second", 2)),
        time_scaled_video=windowed,
        num_position_embeddings=grid,
        side_row_layers=deepstack,
    )


def _audio_config(raw: dict, architecture: str, text: TextConfig) -> AudioConfig | None:
    if architecture not in (QWEN2_AUDIO, *OMNI_FAMILY):
        return None
    a = raw.get("audio_config") or {}  # transformers' defaults (Qwen2-Audio's and Omni's towers are the same size)
    omni = architecture in OMNI_FAMILY
    d_model, heads = a.get("d_model", 1280), a.get("encoder_attention_heads", 20)
    if d_model % heads:
        raise ModelLoadError(f"audio d_model {d_model} is not divisible by its {heads} attention heads")
    # Qwen2-Audio's multi_modal_projector maps d_model to the LM width; Omni's tower projects to output_dim itself.
    output_dim = a.get("output_dim", 3584) if omni else text.hidden_size
    if output_dim != text.hidden_size:
        raise ModelLoadError(f"audio output width {output_dim} != language model hidden size {text.hidden_size}")
    n_window = a.get("n_window", 100) if omni else 0
    if omni and not 0 < n_window <= a.get("max_source_positions", 1500):
        raise ModelLoadError(f"audio n_window {n_window} must be positive and within max_source_positions")
    return AudioConfig(
        num_mel_bins=a.get("num_mel_bins", 128),
        d_model=d_model,
        layers=a.get("encoder_layers", 32),
        heads=heads,
        ffn_dim=a.get("encoder_ffn_dim", 5120),
        max_source_positions=a.get("max_source_positions", 1500),
        output_dim=output_dim,
        context_frames=0 if omni else 2,
        activation=a.get("activation_function", "gelu"),
        n_window=n_window,
        position_id_per_seconds=float(raw.get("position_id_per_seconds", 25)),
        seconds_per_chunk=float(raw.get("seconds_per_chunk", 2)),
    )


def parse_qwen_config(raw: dict, folder: Path, architecture: str) -> ModelConfig:
    top = raw  # dtype, versions: the file's own
    if architecture == QWEN2_5_OMNI:  # the full Omni checkpoint: we serve its thinker (text out)
        raw = require(raw, "thinker_config", "config.json")
    qwen3_5 = architecture in QWEN3_5_FAMILY
    text = _qwen3_5_text_config(raw, architecture) if qwen3_5 else _text_config(raw, architecture)
    vision = _vision_config(raw, architecture, text)
    audio = _audio_config(raw, architecture, text)
    dtype = (top.get("dtype") or top.get("torch_dtype") or raw.get("dtype")
             or (raw.get("text_config") or {}).get("dtype"))
    # A model without pictures has no picture tokens, one that does not hear no audio tokens (-1: none).
    # Qwen2-Audio's <|audio_bos|>/<|audio_eos|> are plain text around <|AUDIO|>: its config names them not.
    omni = architecture in OMNI_FAMILY
    media_ids = {
        "image_token_id": token_id(raw, "image_token_id", "image_token_index", default=248056 if qwen3_5 else 151655),
        "video_token_id": token_id(raw, "video_token_id", "video_token_index", default=248057 if qwen3_5 else 151656),
        "vision_start_token_id": token_id(raw, "vision_start_token_id", default=248053 if qwen3_5 else 151652),
        "vision_end_token_id": token_id(raw, "vision_end_token_id", default=248054 if qwen3_5 else 151653),
    } if vision is not None else dict.fromkeys(("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id"), -1)
    if audio is not None:
        media_ids |= {
            "audio_token_id": token_id(raw, "audio_token_id", "audio_token_index", default=151646),
            "audio_start_token_id": token_id(raw, "audio_start_token_id", default=151647 if omni else -1),
            "audio_end_token_id": token_id(raw, "audio_end_token_id", default=151648 if omni else -1),
        }
    return ModelConfig(
        architecture=architecture,
        text=text,
        vision=vision,
        eos_token_ids=eos_ids(raw, folder),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        transformers_major=transformers_major(top),
        quantization=quantization_items(top) or quantization_items(raw),  # full Omni: either level
        audio=audio,
        position_kind="omni" if omni else "rope" if vision is None else "mrope",
        video_rules="qwen3" if architecture in QWEN3_FAMILY + QWEN3_5_FAMILY else "qwen2",
        **media_ids,
    )
