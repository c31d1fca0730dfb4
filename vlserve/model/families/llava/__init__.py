"""The LLaVA family: LLaVA-OneVision (SigLIP tower, Qwen2 LM) and LLaVA-NeXT-Video (CLIP tower, Llama LM)."""

from __future__ import annotations

from vlserve.model.families.base import ModelFamily
from vlserve.model.families.llava.config import ARCHITECTURES, parse_llava_config

LLAVA = ModelFamily(
    name="llava",
    architectures=ARCHITECTURES,
    parse_config=parse_llava_config,
    model="vlserve.model.families.llava.model:build",
    weight_names="vlserve.model.families.llava.weights:our_name",
    check_item="vlserve.model.families.llava.checks:check_item",
    processor="vlserve.model.families.llava.processor:LlavaProcessor",
)
