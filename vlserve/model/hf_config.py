"""Read a Hugging Face `config.json` into a `ModelConfig` (vlserve.model.config_types): its `architectures` entry
picks the model family (vlserve.model.families), whose parser reads the rest."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from vlserve.core.errors import ModelLoadError
from vlserve.model.config_types import (  # noqa: F401  (the config types, importable from here as before)
    AudioConfig,
    ModelConfig,
    MoEConfig,
    QuantValue,
    TextConfig,
    VisionConfig,
)
from vlserve.model.families import canonical_architecture, family_of


def parse_model_config(raw: dict, folder: Path) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; cannot tell which model to build")
    architecture = canonical_architecture(archs[0])
    family = family_of(architecture)
    return replace(family.parse_config(raw, folder, architecture), family=family.name)


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    return parse_model_config(raw, folder)
