"""Which model class serves which `architectures` entry of config.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from vlserve.core.errors import UnsupportedModelError
from vlserve.model.hf_config import (
    QWEN2_5_OMNI,
    QWEN2_5_OMNI_THINKER,
    QWEN2_5_VL,
    QWEN2_AUDIO,
    QWEN2_VL,
    QWEN3_VL,
    QWEN3_VL_MOE,
    ModelConfig,
)
from vlserve.model.qwen2_5_vl_vision import Qwen2_5_VLVisionTransformer
from vlserve.model.qwen2_text import Qwen2TextModel
from vlserve.model.qwen2_vl_vision import Qwen2VLVisionTransformer
from vlserve.model.qwen3_text import Qwen3TextModel
from vlserve.model.qwen3_vl_vision import Qwen3VLVisionTransformer
from vlserve.model.vl_model import VisionLanguageModel


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[..., nn.Module]  # (cfg, with_vision=..., with_language=...) -> module


def _vision_language(vision_cls, text_cls) -> ModelSpec:
    return ModelSpec(lambda cfg, **kw: VisionLanguageModel(cfg, vision_cls, text_cls, **kw))


MODEL_REGISTRY: dict[str, ModelSpec] = {
    QWEN2_VL: _vision_language(Qwen2VLVisionTransformer, Qwen2TextModel),
    QWEN2_5_VL: _vision_language(Qwen2_5_VLVisionTransformer, Qwen2TextModel),
    QWEN3_VL: _vision_language(Qwen3VLVisionTransformer, Qwen3TextModel),  # dense and MoE: the config says which
    QWEN3_VL_MOE: _vision_language(Qwen3VLVisionTransformer, Qwen3TextModel),
    # Audio: the tower comes with the config's `audio` (model/audio_encoder.py).
    QWEN2_AUDIO: _vision_language(None, Qwen2TextModel),  # a Qwen2 LM with 1-D RoPE (equal position rows)
    # Omni's thinker: its vision tower computes what Qwen2.5-VL's does (q/k/v stored apart: the loader fuses them)
    QWEN2_5_OMNI_THINKER: _vision_language(Qwen2_5_VLVisionTransformer, Qwen2TextModel),
    QWEN2_5_OMNI: _vision_language(Qwen2_5_VLVisionTransformer, Qwen2TextModel),  # the full checkpoint's thinker
}


def get_model_spec(cfg: ModelConfig) -> ModelSpec:
    spec = MODEL_REGISTRY.get(cfg.architecture)
    if spec is None:
        raise UnsupportedModelError(
            f"architecture '{cfg.architecture}' is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return spec
