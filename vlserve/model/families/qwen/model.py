"""Which Qwen model class serves which architecture: a media tower or two and a decoder in a
`VisionLanguageModel` (the audio tower comes with the config's `audio`, vlserve.model.audio_encoder)."""

from __future__ import annotations

import math
from functools import partial

import torch.nn as nn

from vlserve.model.config_types import ModelConfig
from vlserve.model.families.qwen.checks import item_tokens
from vlserve.model.families.qwen.config import (
    QWEN2_5_OMNI,
    QWEN2_5_OMNI_THINKER,
    QWEN2_5_VL,
    QWEN2_AUDIO,
    QWEN2_VL,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_VL,
    QWEN3_VL_MOE,
)
from vlserve.model.families.qwen.qwen2_5_vl_vision import Qwen2_5_VLVisionTransformer
from vlserve.model.families.qwen.qwen2_vl_vision import Qwen2VLVisionTransformer
from vlserve.model.families.qwen.qwen3_5_text import Qwen3_5TextModel
from vlserve.model.families.qwen.qwen3_text import Qwen3TextModel
from vlserve.model.families.qwen.qwen3_vl_vision import Qwen3VLVisionTransformer
from vlserve.model.qwen2_text import Qwen2TextModel
from vlserve.model.vl_model import VisionLanguageModel

# architecture -> (vision tower class or None, decoder class)
PARTS: dict[str, tuple[type[nn.Module] | None, type[nn.Module]]] = {
    QWEN2_VL: (Qwen2VLVisionTransformer, Qwen2TextModel),
    QWEN2_5_VL: (Qwen2_5_VLVisionTransformer, Qwen2TextModel),
    QWEN3_VL: (Qwen3VLVisionTransformer, Qwen3TextModel),  # dense and MoE: the config says which
    QWEN3_VL_MOE: (Qwen3VLVisionTransformer, Qwen3TextModel),
    # Qwen3.5: Qwen3-VL's tower without DeepStack (the config has no levels), a hybrid linear-attention decoder
    QWEN3_5: (Qwen3VLVisionTransformer, Qwen3_5TextModel),
    QWEN3_5_MOE: (Qwen3VLVisionTransformer, Qwen3_5TextModel),
    QWEN2_AUDIO: (None, Qwen2TextModel),  # a Qwen2 LM with 1-D RoPE (equal position rows)
    # Omni's thinker: its vision tower computes what Qwen2.5-VL's does (q/k/v stored apart: the loader fuses them)
    QWEN2_5_OMNI_THINKER: (Qwen2_5_VLVisionTransformer, Qwen2TextModel),
    QWEN2_5_OMNI: (Qwen2_5_VLVisionTransformer, Qwen2TextModel),  # the full checkpoint's thinker
}


def build(cfg: ModelConfig, **kw) -> VisionLanguageModel:
    vision_cls, text_cls = PARTS[cfg.architecture]
    return VisionLanguageModel(cfg, vision_cls, text_cls, item_tokens=partial(item_tokens, cfg),
                               item_pixel_rows=math.prod, **kw)  # t * h * w patches
