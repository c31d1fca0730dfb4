"""The InternVL model: InternViT and the projector (vision.py), then a Qwen2 decoder with 1-D RoPE (InternVL3)."""

from __future__ import annotations

from functools import partial

from vlserve.model.config_types import ModelConfig
from vlserve.model.families.internvl.checks import item_pixel_rows, item_tokens
from vlserve.model.families.internvl.vision import InternVLTower
from vlserve.model.layers.parallel import SINGLE, building_for
from vlserve.model.qwen2_text import Qwen2TextModel
from vlserve.model.vl_model import VisionLanguageModel


def build(cfg: ModelConfig, **kw) -> VisionLanguageModel:
    def tower(_vision_cfg) -> InternVLTower:
        with building_for(SINGLE):  # whole on every rank, in either mm_encoder_tp_mode
            return InternVLTower(cfg)

    return VisionLanguageModel(cfg, tower, Qwen2TextModel, item_tokens=partial(item_tokens, cfg),
                               item_pixel_rows=item_pixel_rows, **kw)
