"""What the Qwen families' tiny checkpoints share (qwen/tiny.py builds them): the arch groups, what each of
make-tiny-model's sizes means for a Qwen model beyond the shared `SizeSpec`, and the language model's, vision
tower's and image processor's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlserve.model.families.qwen.tiny_qwen3_5 import QWEN3_5_ARCHES

QWEN3 = ("qwen3_vl", "qwen3_vl_moe")
QWEN3_5 = QWEN3_5_ARCHES
QWEN3_VISION = QWEN3 + QWEN3_5  # Qwen3-VL's tower, patch size and processor files (Qwen3.5: without DeepStack)
OMNI = ("qwen2_5_omni", "qwen2_5_omni_full")
AUDIO = ("qwen2_audio", *OMNI)

# OpenAI CLIP normalisation, which both Qwen2-VL and Qwen2.5-VL use; Qwen3-VL uses 0.5 / 0.5.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
PATCH_SIZE_3 = 16  # Qwen3-VL


@dataclass(frozen=True)
class QwenShape:
    """A size's Qwen-only shapes. The size's `SizeSpec` gives the LM, the tower's width and heads, and the tower
    depth of Qwen2.5-VL and Qwen3-VL (`vit_depth`)."""

    mrope_section: tuple[int, int, int]  # M-RoPE's (t, h, w) split of head_dim / 2
    vit_depth_2: int  # Qwen2-VL ViT depth
    vit_intermediate: int  # Qwen2.5-VL's and Qwen3-VL's gated-MLP width (Qwen2-VL uses mlp_ratio 4)
    fullatt_blocks_25: tuple[int, ...]  # Qwen2.5-VL's full-attention blocks (the others attend in windows)
    max_pixels: int
    layers_3: int  # Qwen3-VL LM depth: more layers than DeepStack levels, or the last level could not matter
    mrope_section_3: tuple[int, int, int]  # Qwen3-VL's own split
    deepstack_3: tuple[int, ...]  # Qwen3-VL blocks feeding DeepStack
    position_grid_3: int  # Qwen3-VL learned position grid side (num_position_embeddings = side^2)
    experts: tuple[int, int, int]  # the MoE LMs: (experts, experts per token, expert intermediate size)
    # Audio tower (Qwen2-Audio, Omni): (d_model, layers, heads, ffn width); Omni's chunk is 2 x n_window frames.
    audio: tuple[int, int, int, int]
    audio_n_window: int


# make-tiny-model's size name -> its Qwen shapes. Qwen3-VL: DeepStack from non-adjacent blocks, and a 4x4 position
# grid smaller than any picture's, so it is resampled. Medium: Qwen3-VL's own M-RoPE split at head_dim 128, and
# Qwen3-VL-MoE is ~550M parameters (top-2 of 8).
SHAPES: dict[str, QwenShape] = {
    "tiny": QwenShape((2, 3, 3), 2, 64, (1, 3), 28 * 28 * 256, layers_3=3, mrope_section_3=(2, 3, 3),
                      deepstack_3=(0, 2), position_grid_3=4, experts=(4, 2, 48), audio=(32, 2, 2, 64),
                      audio_n_window=10),
    "small": QwenShape((4, 6, 6), 2, 128, (1, 3), 28 * 28 * 256, layers_3=4, mrope_section_3=(4, 6, 6),
                       deepstack_3=(0, 2), position_grid_3=8, experts=(4, 2, 96), audio=(64, 2, 4, 128),
                       audio_n_window=10),
    "medium": QwenShape((16, 24, 24), 8, 1728, (3, 7), 1003520, layers_3=12, mrope_section_3=(24, 20, 20),
                        deepstack_3=(1, 3, 5), position_grid_3=48, experts=(8, 2, 1536), audio=(512, 6, 8, 2048),
                        audio_n_window=100),
}


def check_shape(spec, shape: QwenShape) -> None:
    head_dim = spec.hidden // spec.heads
    if sum(shape.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {shape.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    # The vision 2-D rotary embedding splits each head into (h, w) halves of cos/sin pairs.
    if (spec.vit_width // spec.vit_heads) % 4:
        raise ValueError("vision head_dim must be divisible by 4")


def lm_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The LM config's bos / eos / pad (the chat turn's end is the eos)."""
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}


def text_config(spec, vocab_size: int, token_ids: dict[str, int], init_range: float) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_range,
        **token_ids,
    }


def vision_config(arch: str, spec, shape: QwenShape, init_range: float) -> dict[str, Any]:
    common = {
        "num_heads": spec.vit_heads,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "initializer_range": init_range,
    }
    if arch in QWEN3_VISION:
        deepstack = {"deepstack_visual_indexes": list(shape.deepstack_3)} if arch in QWEN3 else {}
        return {**common, "patch_size": PATCH_SIZE_3, "hidden_size": spec.vit_width, "out_hidden_size": spec.hidden,
                "intermediate_size": shape.vit_intermediate, "depth": spec.vit_depth, **deepstack,
                "num_position_embeddings": shape.position_grid_3**2, "hidden_act": "gelu_pytorch_tanh"}
    if arch == "qwen2_vl":
        # In Qwen2-VL `hidden_size` is the merger's output width (= LM hidden), `embed_dim` the ViT width.
        return {**common, "embed_dim": spec.vit_width, "hidden_size": spec.hidden, "depth": shape.vit_depth_2,
                "mlp_ratio": 4, "hidden_act": "quick_gelu"}
    # In Qwen2.5-VL `hidden_size` is the ViT width and `out_hidden_size` the merger's output width.
    return {**common, "hidden_size": spec.vit_width, "out_hidden_size": spec.hidden,
            "intermediate_size": shape.vit_intermediate, "depth": spec.vit_depth,
            "fullatt_block_indexes": list(shape.fullatt_blocks_25), "window_size": 112,
            "hidden_act": "silu", "tokens_per_second": 2}


def image_processor_config(arch: str, max_pixels: int) -> dict[str, Any]:
    """Qwen2VLImageProcessor's fields (preprocessor_config.json)."""
    qwen3 = arch in QWEN3_VISION
    patch = PATCH_SIZE_3 if qwen3 else PATCH_SIZE
    min_pixels = (patch * MERGE_SIZE * 2) ** 2 if qwen3 else MIN_PIXELS
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5] * 3 if qwen3 else CLIP_MEAN,
        "image_std": [0.5] * 3 if qwen3 else CLIP_STD,
        "resample": 3,  # PIL bicubic
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
