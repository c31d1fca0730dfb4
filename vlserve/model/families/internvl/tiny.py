"""InternVL3's part of `make-tiny-model` (vlserve.tools.tiny_model's builder interface): the config (InternViT
tower, Qwen2 LM of the tiny size), the tokenizer's special tokens and chat template laid out as
OpenGVLab/InternVL3-*-hf's are, and the processor files transformers' InternVLProcessor reads.

Tiles are 56 px (patch 14: 4 x 4 patches, 2 x 2 tokens after the pixel shuffle) and a picture takes up to 6 tiles
and a thumbnail, so tests are fast; the layer scales start at 1 and the class row and position table are random
(transformers zeroes them), so every part of the tower changes its output.
"""

from __future__ import annotations

from typing import Any

import torch

ARCH = "internvl3"
TILE, PATCH, MAX_TILES = 56, 14, 6
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# Qwen2's three, then InternVL's (the ids follow in this order in InternVL3's tokenizer: 151665, 151666, 151667)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
TOKEN_NAMES = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
               "video_token": "<video>"}
# InternVL3-*-hf's layout: "<|im_start|>user\n<IMG_CONTEXT>\nquestion<|im_end|>\n", parts in their order
CHAT_TEMPLATE = """
{%- for message in messages -%}
  {{- '<|im_start|>' ~ message['role'] ~ '\\n' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- else -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}
      {%- elif part['type'] == 'video' -%}{{- '<video>\\n' -}}
      {%- elif part['type'] == 'text' -%}{{- part['text'] -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".strip()


def tokenizer_spec(arch: str) -> tuple:
    return SPECIAL_TOKENS, CHAT_TEMPLATE, TOKEN_NAMES, "<|im_end|>", "<|endoftext|>"


def generation_ids(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"]}


def model_config(arch: str, spec, vocab_size: int, ids: dict[str, int], init_range: float, config_cls) -> Any:
    token_ids = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                 "pad_token_id": ids["<|endoftext|>"]}
    text = {"model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "hidden_act": "silu", "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "initializer_range": init_range, "tie_word_embeddings": spec.tie_embeddings, **token_ids}
    vision = {"model_type": "internvl_vision", "hidden_size": spec.vit_width, "intermediate_size": 2 * spec.vit_width,
              "num_hidden_layers": spec.vit_depth, "num_attention_heads": spec.vit_heads, "image_size": TILE,
              "patch_size": PATCH, "attention_bias": True, "use_qk_norm": False, "norm_type": "layer_norm",
              "use_mean_pooling": True, "layer_scale_init_value": 1.0, "hidden_act": "gelu",
              "initializer_range": init_range}
    return config_cls(text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                      image_seq_length=(TILE // PATCH // 2) ** 2, downsample_ratio=0.5, projector_hidden_act="gelu",
                      vision_feature_layer=-1, vision_feature_select_strategy="default",
                      tie_word_embeddings=spec.tie_embeddings, initializer_range=init_range, **token_ids)


def randomize(model, init_range: float) -> None:
    """The class row and the position table drawn like the other weights (transformers zeroes them)."""
    emb = model.model.vision_tower.embeddings
    with torch.no_grad():
        emb.cls_token.normal_(0.0, init_range)
        emb.position_embeddings.normal_(0.0, init_range)


def processor_files(arch: str, spec) -> dict[str, dict[str, Any]]:
    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, "resample": 3, "size": {"height": TILE, "width": TILE},
              "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}
    pictures = common | {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": False,
                         "min_patches": 1, "max_patches": MAX_TILES, "processor_class": "InternVLProcessor"}
    video = common | {"video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor"}
    return {"preprocessor_config.json": pictures, "video_preprocessor_config.json": video,
            "processor_config.json": {"processor_class": "InternVLProcessor",
                                      "image_seq_length": (TILE // PATCH // 2) ** 2}}


# an LM matrix, a tower block's and the projector's: initializer_range reached them
PROBES = ("model.layers.0.self_attn.q_proj.weight", "encoder.layer.0.attention.q_proj.weight",
          "multi_modal_projector.linear_1.weight")
