"""Read a LLaVA-OneVision or LLaVA-NeXT-Video config.json into a `ModelConfig` (being written)."""

from __future__ import annotations

from pathlib import Path

from vlserve.core.errors import UnsupportedModelError
from vlserve.model.config_types import ModelConfig

LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"
LLAVA_NEXT_VIDEO = "LlavaNextVideoForConditionalGeneration"
ARCHITECTURES = (LLAVA_ONEVISION, LLAVA_NEXT_VIDEO)


def parse_llava_config(raw: dict, folder: Path, architecture: str) -> ModelConfig:
    raise UnsupportedModelError(f"{architecture}: not served yet")
