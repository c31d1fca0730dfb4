"""What a front end knows of its engine: the model facts it resolved (and shipped to the engine process) and the
engine options that bound a prompt. Built without the engine's config module: no weights, no KV sizing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlserve.core.config import EngineArgs
from vlserve.model.facts import ModelFacts
from vlserve.model.config_types import ModelConfig


@dataclass(frozen=True)
class FrontendConfig:
    """The names are the engine config's (`VlserveConfig`), so prompt processing reads either the same way."""

    facts: ModelFacts
    max_num_seqs: int
    encoder_cache_size: int
    max_num_encoder_input_tokens: int
    max_video_frames: int
    limit_mm_per_prompt: dict[str, int]
    enable_mm_embeds: bool
    load_vision: bool

    @classmethod
    def of(cls, facts: ModelFacts, args: EngineArgs) -> FrontendConfig:
        return cls(facts, args.max_num_seqs, facts.encoder_cache_size, facts.max_num_encoder_input_tokens,
                   args.max_video_frames, args.mm_limits(), args.enable_mm_embeds, args.load_vision)

    @property
    def model(self) -> ModelConfig:
        return self.facts.model

    @property
    def model_path(self) -> Path:
        return self.facts.path

    @property
    def dtype(self) -> torch.dtype:
        return self.facts.torch_dtype

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len
