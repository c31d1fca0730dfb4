"""The model families `make-tiny-model --arch` writes: the one list of them (these, then what each family's
descriptor adds: `ModelFamily.tiny_arches`, built by the family's own builder module).

Light on purpose (no torch, no transformers): `vlserve --help` reads it to say which families there are, and
tiny_model.py resolves the transformers classes named here when it runs. A test keeps this list equal to the
architectures vlserve serves (vlserve.model.registry).
"""

from __future__ import annotations

from vlserve.model.families import FAMILIES
from vlserve.model.families.base import TinyArch

TINY_ARCHES: dict[str, TinyArch] = {
    "qwen2_vl": TinyArch("Qwen2-VL", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": TinyArch("Qwen2.5-VL", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": TinyArch("Qwen3-VL", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": TinyArch("Qwen3-VL-MoE", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_5": TinyArch("Qwen3.5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": TinyArch("Qwen3.5-MoE", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "qwen2_audio": TinyArch("Qwen2-Audio", "Qwen2AudioConfig", "Qwen2AudioForConditionalGeneration"),
    "qwen2_5_omni": TinyArch("Qwen2.5-Omni", "Qwen2_5OmniThinkerConfig", "Qwen2_5OmniThinkerForConditionalGeneration"),
    # The checkpoint as released: thinker, talker and token2wav (vlserve serves the thinker).
    "qwen2_5_omni_full": TinyArch("Qwen2.5-Omni (full)", "Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration"),
}
for _family in FAMILIES:
    TINY_ARCHES.update(_family.tiny_arches)


def family_names() -> str:
    """"Qwen2-VL, Qwen2.5-VL, ...": for help texts."""
    return ", ".join(a.family for a in TINY_ARCHES.values())
