"""What a model family tells the rest of vlserve (the interface; each family is one folder beside this file).

A family parses its config.json into the shared `ModelConfig`, builds its model (media towers and decoder, with
the methods the engine calls: `encode_images`, `encode_audio`, `embed_tokens`, `forward`, `compute_logits`),
names its checkpoint tensors, checks a media item's encoder input against its token count on the engine's side,
and turns a prompt's media into items, placeholders and positions on the request path (its
`MultiModalProcessor`, vlserve.model.families.processor).

Light on purpose: config parsing runs in `vlserve --help`-cheap processes, so everything heavy (torch modules,
image code) is named here as "module:attribute" and imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from vlserve.model.config_types import ModelConfig


@cache
def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class TinyArch:
    """A small random checkpoint `make-tiny-model --arch` writes (vlserve.tools.tiny_model) for tests and demos."""

    family: str  # the family's name as its model cards write it
    config_class: str  # transformers class names
    model_class: str  # also config.json's `architectures` entry
    # "module" of the family's own builder (its tokenizer, config and processor files: the interface
    # vlserve.tools.tiny_model documents)
    builder: str
    # make-tiny-model's arch when none is named, and the demo checkpoint's: one arch of all the families
    default: bool = False


@dataclass(frozen=True)
class MediaBounds:
    """The server's bounds on one media item (its options of the same names): what the largest item the encoder
    may be asked to take follows from."""

    max_image_pixels: int
    max_video_frames: int
    max_audio_seconds: float


@dataclass(frozen=True)
class ModelFamily:
    name: str  # "qwen", "llava": also ModelConfig.family
    architectures: tuple[str, ...]  # config.json `architectures` entries it serves
    # (raw config.json, its folder, architecture) -> ModelConfig; raises ModelLoadError for what it cannot serve
    parse_config: Callable[[dict, Path, str], ModelConfig]
    # "module:function": (cfg, with_vision=, with_language=, vision_tp=, towers=) -> the model, built under the
    # current tensor-parallel group on the current (meta) device; the loader fills it
    model: str
    # "module:function": checkpoint tensor name -> (our parameter name, fused shard or None); None: skip it
    weight_names: str
    # "module:function": (MultiModalItem, ModelConfig) -> None, raising InvalidInputError when the item's encoder
    # input (pixel values, audio features) does not make its token count (the engine checks every prompt)
    check_item: str
    processor: str  # "module:Class": its MultiModalProcessor
    # "module:function": (ModelConfig, checkpoint folder, MediaBounds) -> the most embedding tokens one media item
    # takes as a request without mm_processor_kwargs is processed (the encoder budgets are sized to take it)
    largest_item: str
    aliases: dict[str, str] = field(default_factory=dict)  # architecture names read as another of its own
    tiny_arches: dict[str, TinyArch] = field(default_factory=dict)  # `make-tiny-model --arch` names it adds

    def load(self, ref: str) -> Any:
        """One of the "module:attribute" references above, imported once."""
        return _resolve(ref)
