"""Which model class serves which `architectures` entry of config.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from vlserve.core.errors import UnsupportedModelError
from vlserve.model.hf_config import ModelConfig
from vlserve.model.qwen2_5_vl_vision import Qwen2_5_VLVisionTransformer
from vlserve.model.qwen2_vl import Qwen2VLForGeneration
from vlserve.model.qwen2_vl_vision import Qwen2VLVisionTransformer


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[..., nn.Module]  # (cfg, with_vision=..., with_language=...) -> module


def _qwen2_vl_family(vision_cls):
    return lambda cfg, **kw: Qwen2VLForGeneration(cfg, vision_cls, **kw)


MODEL_REGISTRY: dict[str, ModelSpec] = {
    "Qwen2VLForConditionalGeneration": ModelSpec(_qwen2_vl_family(Qwen2VLVisionTransformer)),
    "Qwen2_5_VLForConditionalGeneration": ModelSpec(_qwen2_vl_family(Qwen2_5_VLVisionTransformer)),
}


def get_model_spec(cfg: ModelConfig) -> ModelSpec:
    spec = MODEL_REGISTRY.get(cfg.architecture)
    if spec is None:
        raise UnsupportedModelError(
            f"architecture '{cfg.architecture}' is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return spec
