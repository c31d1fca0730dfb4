"""The model families vlserve serves, by config.json `architectures` entry: the one registry.

Adding a family is adding a folder here (config parsing, model, weight names, item checks, processor) and its
descriptor to `FAMILIES`; nothing in the engine, scheduler, caches or disaggregation names a family
(tests/test_layers.py checks).
"""

from __future__ import annotations

from vlserve.core.errors import UnsupportedModelError
from vlserve.model.families.base import ModelFamily
from vlserve.model.families.internvl import INTERNVL
from vlserve.model.families.llava import LLAVA
from vlserve.model.families.qwen import QWEN

FAMILIES: tuple[ModelFamily, ...] = (QWEN, LLAVA, INTERNVL)
_BY_ARCHITECTURE = {arch: fam for fam in FAMILIES for arch in (*fam.architectures, *fam.aliases)}


def supported_architectures() -> list[str]:
    return sorted(arch for fam in FAMILIES for arch in fam.architectures)


def family_of(architecture: str) -> ModelFamily:
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise UnsupportedModelError(f"architecture '{architecture}' is not supported; supported: "
                                    f"{', '.join(supported_architectures())}")
    return family


def family_named(name: str) -> ModelFamily:
    return next(f for f in FAMILIES if f.name == name)


def canonical_architecture(architecture: str) -> str:
    """The class name a family serves an alias as (a released checkpoint's older class name)."""
    family = _BY_ARCHITECTURE.get(architecture)
    return family.aliases.get(architecture, architecture) if family else architecture
