"""The model families `make-tiny-model --arch` writes: the one list of them, gathered from the families'
descriptors (`ModelFamily.tiny_arches`, each built by its family's own builder module).

Light on purpose (no torch, no transformers): `vlserve --help` reads it to say which families there are, and
tiny_model.py resolves the transformers classes named here when it runs. A test keeps this list equal to the
architectures vlserve serves (vlserve.model.registry).
"""

from __future__ import annotations

from vlserve.model.families import FAMILIES
from vlserve.model.families.base import TinyArch

TINY_ARCHES: dict[str, TinyArch] = {name: arch for family in FAMILIES for name, arch in family.tiny_arches.items()}
# make_tiny_model's arch when none is named, and the demo checkpoint's: the one (exactly) a family marks default
(DEFAULT_ARCH,) = (name for name, arch in TINY_ARCHES.items() if arch.default)


def family_names() -> str:
    """"Qwen2-VL, Qwen2.5-VL, ...": for help texts."""
    return ", ".join(a.family for a in TINY_ARCHES.values())
