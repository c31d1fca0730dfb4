"""The Qwen families' part of `make-tiny-model` (vlserve.tools.tiny_model's builder interface): Qwen2-VL,
Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE) (its hybrid decoder: tiny_qwen3_5.py), Qwen2-Audio and Qwen2.5-Omni
(tiny_audio.py), thinker alone or the full model. Their tokenizers are in tiny_tokens.py, the pieces they share
(each size's Qwen shapes, the LM and vision tower configs, the image processor's fields) in tiny_parts.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlserve.model.families.qwen import tiny_audio, tiny_qwen3_5
from vlserve.model.families.qwen.tiny_parts import (
    AUDIO,
    MERGE_SIZE,
    OMNI,
    PATCH_SIZE_3,
    QWEN3,
    QWEN3_5,
    QWEN3_VISION,
    SHAPES,
    TEMPORAL_PATCH_SIZE,
    check_shape,
    image_processor_config,
    lm_token_ids,
    text_config,
    vision_config,
)
from vlserve.model.families.qwen.tiny_tokens import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZERS,
)


def tokenizer_spec(arch: str) -> tuple:
    """(special tokens, chat template, tokenizer attributes naming them, eos token, pad token)."""
    special, template, names = TOKENIZERS.get(arch, (SPECIAL_TOKENS, CHAT_TEMPLATE, None))
    return special, template, names, EOS_TOKEN, PAD_TOKEN


def generation_ids(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    """Qwen stops on <|im_end|> in chat and on <|endoftext|> for raw text."""
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"]}


def model_config(arch: str, spec, vocab_size: int, ids: dict[str, int], init_range: float, config_cls) -> Any:
    """The transformers config of `spec` (make-tiny-model's SizeSpec) with the Qwen shapes of its size."""
    shape = SHAPES[spec.name]
    check_shape(spec, shape)
    if arch in AUDIO:
        return tiny_audio.model_config(arch, spec, shape, vocab_size, ids, init_range, config_cls)
    token_ids = lm_token_ids(ids)
    text = text_config(spec, vocab_size, token_ids, init_range)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(shape.mrope_section),
                               "rope_theta": 1000000.0}
    if arch in QWEN3:
        text["head_dim"] = spec.hidden // spec.heads
        text["num_hidden_layers"] = shape.layers_3
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(shape.mrope_section_3),
                                   "mrope_interleaved": True, "rope_theta": 5000000.0}
    if arch in QWEN3_5:
        text = tiny_qwen3_5.text_config(arch, spec.name, text, shape.experts)
    if arch == "qwen3_vl_moe":
        text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"] = shape.experts
        text["decoder_sparse_step"] = 1
    # Released Qwen2-VL / Qwen2.5-VL configs name <|vision_pad|> too, at both levels (Dynamo's media routing
    # reads the text config's)
    vision_pad = {} if arch in QWEN3 or arch in QWEN3_5 else {"vision_token_id": ids["<|vision_pad|>"]}
    text.update(vision_pad)
    return config_cls(
        text_config=text,
        vision_config=vision_config(arch, spec, shape, init_range),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_embeddings,
        # Duplicated at the top level because flat (hub-style) readers look for them there.
        **token_ids,
        **vision_pad,
    )


def _video_processor_config(max_pixels: int) -> dict[str, Any]:
    """Qwen3-VL reads video settings from their own file: sampling rate, frame bounds, total pixel budget."""
    factor = PATCH_SIZE_3 * MERGE_SIZE
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": (2 * factor) ** 2, "longest_edge": 16 * max_pixels},
        "patch_size": PATCH_SIZE_3,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 64,
        "do_sample_frames": True,
    }


def processor_files(arch: str, spec) -> dict[str, dict[str, Any]]:
    """file name -> contents: the image processor's (the audio families': the feature extractor's, Omni's with the
    image processor's fields), Qwen3-VL's video processor's; the pixel budget grows with the size."""
    max_pixels = SHAPES[spec.name].max_pixels
    if arch in AUDIO:
        return {"preprocessor_config.json": tiny_audio.preprocessor_config(arch, max_pixels)}
    files = {"preprocessor_config.json": image_processor_config(arch, max_pixels)}
    if arch in QWEN3_VISION:
        files["video_preprocessor_config.json"] = _video_processor_config(max_pixels)
    return files


def write_extra_files(arch: str, out_dir: Path) -> None:
    """transformers' full Omni model loads its talker's voices from spk_dict.pt (none here)."""
    if arch == "qwen2_5_omni_full":
        torch.save({}, out_dir / "spk_dict.pt")


def probes(arch: str) -> tuple[str, ...]:
    """One text matrix and one of each tower: initializer_range reached every sub-config."""
    if arch in QWEN3_5:
        return tiny_qwen3_5.PROBES
    found = ("model.layers.0.self_attn.q_proj.weight",)
    found += ("audio_tower.layers.0.self_attn.q_proj.weight",) if arch in AUDIO else ()
    found += ("visual.blocks.0.attn.q.weight",) if arch in OMNI else ()
    found += ("visual.blocks.0.attn.qkv.weight",) if arch not in AUDIO else ()
    return found
