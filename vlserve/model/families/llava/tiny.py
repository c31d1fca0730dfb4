"""The LLaVA parts of `make-tiny-model` (vlserve.tools.tiny_model's builder interface): LLaVA-OneVision (SigLIP
tower, Qwen2 LM) and LLaVA-NeXT-Video (CLIP tower, Llama LM) configs, their tokenizers' special tokens and chat
templates (laid out as the llava-hf checkpoints' are), and the processor files the transformers processors read.

Tiles are 56 px (patch 14: 4 x 4 patches per tile) so tests are fast; OneVision's pinpoints reach 4 x 4 tiles, so
big pictures take its anyres_max_9 downscale, as real ones do at 6 x 6 tiles of 384 px.
"""

from __future__ import annotations

from typing import Any

LLAVA_ONEVISION, LLAVA_NEXT_VIDEO = "llava_onevision", "llava_next_video"
LLAVA = (LLAVA_ONEVISION, LLAVA_NEXT_VIDEO)
TILE, PATCH = 56, 14
ONEVISION_PINPOINTS = [[TILE * a, TILE * b] for a in range(1, 5) for b in range(1, 5)]
NEXT_VIDEO_PINPOINTS = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE], [3 * TILE, TILE], [TILE, 3 * TILE]]
SIGLIP_MEAN_STD = [0.5] * 3
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2's three, then OneVision's placeholders (the ids follow as in llava-onevision-qwen2-*-hf: 151646, 151647)
ONEVISION_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
# Llama's three, then NeXT-Video's placeholders
NEXT_VIDEO_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<video>", "<image>")
TOKEN_NAMES = {"image_token": "<image>", "video_token": "<video>"}

# llava-onevision-qwen2-*-ov-hf's layout: "<|im_start|>user <image>\nquestion<|im_end|>\n": a turn's pictures,
# then its videos, then its texts (each after a newline). String contents are rendered as one text part.
ONEVISION_CHAT_TEMPLATE = """
{%- for message in messages -%}
  {{- '<|im_start|>' ~ message['role'] ~ ' ' -}}
  {%- if message['content'] is string -%}
    {{- '\\n' ~ message['content'] -}}
  {%- else -%}
    {%- for part in message['content'] if part['type'] == 'image' -%}{{- '<image>' -}}{%- endfor -%}
    {%- for part in message['content'] if part['type'] == 'video' -%}{{- '<video>' -}}{%- endfor -%}
    {%- for part in message['content'] if part['type'] == 'text' -%}{{- '\\n' ~ part['text'] -}}{%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".strip()
# LLaVA-NeXT-Video-*-hf's layout: "USER: <video>\nquestion ASSISTANT:" (a system turn's text without a role).
NEXT_VIDEO_CHAT_TEMPLATE = """
{%- for message in messages -%}
  {%- if message['role'] != 'system' -%}{{- message['role'].upper() ~ ': ' -}}{%- endif -%}
  {%- if message['content'] is string -%}
    {{- message['content'] ~ ' ' -}}
  {%- else -%}
    {%- for part in message['content'] if part['type'] == 'image' -%}{{- '<image>\\n' -}}{%- endfor -%}
    {%- for part in message['content'] if part['type'] == 'video' -%}{{- '<video>\\n' -}}{%- endfor -%}
    {%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] ~ ' ' -}}{%- endfor -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- 'ASSISTANT:' -}}
{%- endif -%}
""".strip()

# arch -> (special tokens, chat template, tokenizer attributes, eos token, pad token)
TOKENIZERS = {
    LLAVA_ONEVISION: (ONEVISION_SPECIAL_TOKENS, ONEVISION_CHAT_TEMPLATE, TOKEN_NAMES, "<|im_end|>", "<|endoftext|>"),
    LLAVA_NEXT_VIDEO: (NEXT_VIDEO_SPECIAL_TOKENS, NEXT_VIDEO_CHAT_TEMPLATE, TOKEN_NAMES, "</s>", "<unk>"),
}


def tokenizer_spec(arch: str) -> tuple:
    """(special tokens, chat template, tokenizer attributes, eos token, pad token): tiny_model's builder interface."""
    return TOKENIZERS[arch]


def generation_ids(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    """bos / eos / pad ids of the generation config."""
    if arch == LLAVA_ONEVISION:
        return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                "pad_token_id": ids["<|endoftext|>"]}
    return {"bos_token_id": ids["<s>"], "eos_token_id": [ids["</s>"]], "pad_token_id": ids["<unk>"]}


def model_config(arch: str, spec, vocab_size: int, ids: dict[str, int], init_range: float, config_cls) -> Any:
    """The transformers config: the tiny size's LM (Qwen2 or Llama) and tower, LLaVA's fields as released."""
    onevision = arch == LLAVA_ONEVISION
    gen = generation_ids(arch, ids)
    token_ids = {"bos_token_id": gen["bos_token_id"], "eos_token_id": gen["eos_token_id"][0],
                 "pad_token_id": gen["pad_token_id"]}
    text = {"model_type": "qwen2" if onevision else "llama", "vocab_size": vocab_size, "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "hidden_act": "silu",
            "max_position_embeddings": 32768 if onevision else 4096, "rms_norm_eps": 1e-6 if onevision else 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0 if onevision else 10000.0},
            "initializer_range": init_range, "tie_word_embeddings": spec.tie_embeddings, **token_ids}
    vision = {"model_type": "siglip_vision_model" if onevision else "clip_vision_model",
              "hidden_size": spec.vit_width, "intermediate_size": 2 * spec.vit_width,
              "num_hidden_layers": spec.vit_depth, "num_attention_heads": spec.vit_heads, "image_size": TILE,
              "patch_size": PATCH, "initializer_range": init_range}
    if onevision:
        vision |= {"vision_use_head": False}
        media = {"vision_feature_select_strategy": "full", "vision_feature_layer": -1,
                 "image_grid_pinpoints": ONEVISION_PINPOINTS, "vision_aspect_ratio": "anyres_max_9",
                 "image_token_index": ids["<image>"], "video_token_index": ids["<video>"]}
    else:
        vision |= {"projection_dim": spec.hidden}
        media = {"vision_feature_select_strategy": "default", "vision_feature_layer": -2,
                 "image_grid_pinpoints": NEXT_VIDEO_PINPOINTS, "spatial_pool_mode": "average",
                 "spatial_pool_stride": 2, "image_token_index": ids["<image>"], "video_token_index": ids["<video>"],
                 "image_seq_length": (TILE // PATCH) ** 2, "video_seq_length": (TILE // PATCH // 2) ** 2}
    return config_cls(text_config=text, vision_config=vision, projector_hidden_act="gelu",
                      multimodal_projector_bias=True, tie_word_embeddings=spec.tie_embeddings,
                      initializer_range=init_range, **media, **token_ids)


def processor_files(arch: str, spec) -> dict[str, dict[str, Any]]:
    """file name -> contents: the image processor's, the video processor's and the processor's own settings (the
    same at every size)."""
    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, "resample": 3}
    if arch == LLAVA_ONEVISION:
        pictures = common | {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": TILE,
                             "width": TILE}, "image_grid_pinpoints": ONEVISION_PINPOINTS, "do_pad": True,
                             "image_mean": SIGLIP_MEAN_STD, "image_std": SIGLIP_MEAN_STD,
                             "processor_class": "LlavaOnevisionProcessor"}
        video = common | {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": TILE,
                          "width": TILE}, "image_mean": SIGLIP_MEAN_STD, "image_std": SIGLIP_MEAN_STD,
                          "processor_class": "LlavaOnevisionProcessor"}
        processor = {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": (TILE // PATCH) ** 2,
                     "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9",
                     "image_token": "<image>", "video_token": "<video>"}
    else:
        crop = {"size": {"shortest_edge": TILE}, "crop_size": {"height": TILE, "width": TILE},
                "do_center_crop": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
        pictures = common | crop | {"image_processor_type": "LlavaNextImageProcessor", "do_pad": True,
                                    "image_grid_pinpoints": NEXT_VIDEO_PINPOINTS,
                                    "processor_class": "LlavaNextVideoProcessor"}
        video = common | crop | {"video_processor_type": "LlavaNextVideoVideoProcessor",
                                 "processor_class": "LlavaNextVideoProcessor"}
        processor = {"processor_class": "LlavaNextVideoProcessor", "patch_size": PATCH,
                     "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                     "image_token": "<image>", "video_token": "<video>"}
    return {"preprocessor_config.json": pictures, "video_preprocessor_config.json": video,
            "processor_config.json": processor}


# an LM matrix and the projector's: initializer_range reached them (SigLIP and CLIP initialise their towers by
# their own rules: xavier, or scaled by width and depth)
PROBES = ("model.layers.0.self_attn.q_proj.weight", "multi_modal_projector.linear_1.weight")
