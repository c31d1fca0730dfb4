"""The Qwen family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) with DeepStack, Qwen3.5(-MoE) (hybrid linear attention),
Qwen2-Audio, Qwen2.5-Omni's thinker."""

from __future__ import annotations

from vlserve.model.families.base import ModelFamily, TinyArch
from vlserve.model.families.qwen import config

TINY = "vlserve.model.families.qwen.tiny"  # make-tiny-model's builder for all of them

QWEN = ModelFamily(
    name="qwen",
    architectures=config.ARCHITECTURES,
    parse_config=config.parse_qwen_config,
    model="vlserve.model.families.qwen.model:build",
    weight_names="vlserve.model.families.qwen.weights:our_name",
    check_item="vlserve.model.families.qwen.checks:check_item",
    largest_item="vlserve.model.families.qwen.item_bounds:largest_item_tokens",
    processor="vlserve.model.families.qwen.processor:QwenProcessor",
    aliases=config.ARCHITECTURE_ALIASES,
    tiny_arches={
        "qwen2_vl": TinyArch("Qwen2-VL", "Qwen2VLConfig", config.QWEN2_VL, TINY, default=True),
        "qwen2_5_vl": TinyArch("Qwen2.5-VL", "Qwen2_5_VLConfig", config.QWEN2_5_VL, TINY),
        "qwen3_vl": TinyArch("Qwen3-VL", "Qwen3VLConfig", config.QWEN3_VL, TINY),
        "qwen3_vl_moe": TinyArch("Qwen3-VL-MoE", "Qwen3VLMoeConfig", config.QWEN3_VL_MOE, TINY),
        "qwen3_5": TinyArch("Qwen3.5", "Qwen3_5Config", config.QWEN3_5, TINY),
        "qwen3_5_moe": TinyArch("Qwen3.5-MoE", "Qwen3_5MoeConfig", config.QWEN3_5_MOE, TINY),
        "qwen2_audio": TinyArch("Qwen2-Audio", "Qwen2AudioConfig", config.QWEN2_AUDIO, TINY),
        "qwen2_5_omni": TinyArch("Qwen2.5-Omni", "Qwen2_5OmniThinkerConfig", config.QWEN2_5_OMNI_THINKER, TINY),
        # The checkpoint as released: thinker, talker and token2wav (vlserve serves the thinker).
        "qwen2_5_omni_full": TinyArch("Qwen2.5-Omni (full)", "Qwen2_5OmniConfig", config.QWEN2_5_OMNI, TINY),
    },
)
