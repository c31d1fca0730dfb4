"""The Qwen family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) with DeepStack, Qwen3.5(-MoE) (hybrid linear attention),
Qwen2-Audio, Qwen2.5-Omni's thinker."""

from __future__ import annotations

from vlserve.model.families.base import ModelFamily
from vlserve.model.families.qwen.config import ARCHITECTURE_ALIASES, ARCHITECTURES, parse_qwen_config

QWEN = ModelFamily(
    name="qwen",
    architectures=ARCHITECTURES,
    parse_config=parse_qwen_config,
    model="vlserve.model.families.qwen.model:build",
    weight_names="vlserve.model.families.qwen.weights:our_name",
    check_item="vlserve.model.families.qwen.checks:check_item",
    processor="vlserve.model.families.qwen.processor:QwenProcessor",
    aliases=ARCHITECTURE_ALIASES,
)
