"""The LLaVA family: LLaVA-OneVision (SigLIP tower, Qwen2 LM) and LLaVA-NeXT-Video (CLIP tower, Llama LM)."""

from __future__ import annotations

from vlserve.model.families.base import ModelFamily, TinyArch
from vlserve.model.families.llava.config import ARCHITECTURES, LLAVA_NEXT_VIDEO, LLAVA_ONEVISION, parse_llava_config

TINY = "vlserve.model.families.llava.tiny"  # make-tiny-model's builder for both

LLAVA = ModelFamily(
    name="llava",
    architectures=ARCHITECTURES,
    parse_config=parse_llava_config,
    model="vlserve.model.families.llava.model:build",
    weight_names="vlserve.model.families.llava.weights:our_name",
    check_item="vlserve.model.families.llava.checks:check_item",
    largest_item="vlserve.model.families.llava.item_bounds:largest_item_tokens",
    processor="vlserve.model.families.llava.processor:LlavaProcessor",
    tiny_arches={"llava_onevision": TinyArch("LLaVA-OneVision", "LlavaOnevisionConfig", LLAVA_ONEVISION, TINY),
                 "llava_next_video": TinyArch("LLaVA-NeXT-Video", "LlavaNextVideoConfig", LLAVA_NEXT_VIDEO, TINY)},
)
