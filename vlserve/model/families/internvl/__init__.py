"""The InternVL family: InternVL3 (InternViT tower, pixel shuffle and MLP projector, dynamic tiling with a
thumbnail, Qwen2 LM)."""

from __future__ import annotations

from vlserve.model.families.base import ModelFamily, TinyArch
from vlserve.model.families.internvl.config import ARCHITECTURE, parse_internvl_config

INTERNVL = ModelFamily(
    name="internvl",
    architectures=(ARCHITECTURE,),
    parse_config=parse_internvl_config,
    model="vlserve.model.families.internvl.model:build",
    weight_names="vlserve.model.families.internvl.weights:our_name",
    check_item="vlserve.model.families.internvl.checks:check_item",
    largest_item="vlserve.model.families.internvl.item_bounds:largest_item_tokens",
    processor="vlserve.model.families.internvl.processor:InternVLProcessor",
    tiny_arches={"internvl3": TinyArch("InternVL3", "InternVLConfig", ARCHITECTURE,
                                       "vlserve.model.families.internvl.tiny")},
)
