"""The engine's check of a Qwen media item (whoever built it: a front end, an encoder service): its grid and
encoder input make exactly its token count."""

from __future__ import annotations

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem
from vlserve.model.config_types import ModelConfig


def item_tokens(cfg: ModelConfig, grid_thw: tuple[int, int, int]) -> int:
    """Merged tokens of a picture or video grid (t, h, w in patches)."""
    t, h, w = grid_thw
    return t * h * w // cfg.vision.spatial_merge_size**2


def check_item(item: MultiModalItem, cfg: ModelConfig) -> None:
    _check_grid(item, cfg)
    if item.pixel_values is not None:
        t, h, w = item.layout
        if item.modality == "audio" or tuple(item.pixel_values.shape) != (t * h * w, cfg.vision.patch_dim):
            raise InvalidInputError(f"pixel values of shape {tuple(item.pixel_values.shape)} do not match grid "
                                    f"{item.layout}")
    elif item.audio_features is not None:
        _check_audio_features(item, cfg)


def _check_grid(item: MultiModalItem, cfg: ModelConfig) -> None:
    """A picture's or video's grid in patches, or an audio item's (1, 1, tokens), matches its token count."""
    t, h, w = item.layout
    if item.modality == "audio":
        if (t, h, w) != (1, 1, item.num_tokens) or item.num_tokens <= 0:
            raise InvalidInputError(f"an audio item of {item.num_tokens} tokens has grid {item.layout}; "
                                    f"expected (1, 1, {item.num_tokens})")
        return
    merge = cfg.vision.spatial_merge_size
    if min(t, h, w) <= 0 or h % merge or w % merge:
        raise InvalidInputError(f"grid_thw {item.layout} must be positive with h, w divisible by {merge}")
    if item.num_tokens != item_tokens(cfg, item.layout):
        raise InvalidInputError(f"a media item of grid {item.layout} takes {item_tokens(cfg, item.layout)} "
                                f"tokens, not {item.num_tokens}")


def _check_audio_features(item: MultiModalItem, cfg: ModelConfig) -> None:
    """Features the audio tower can read, as many as its token count needs."""
    from vlserve.model.audio_encoder import audio_output_tokens

    audio = cfg.audio
    feats = item.audio_features
    if item.modality != "audio" or feats.dtype != torch.float32 or feats.dim() != 2 \
            or feats.shape[0] != audio.num_mel_bins:
        raise InvalidInputError(f"audio features are {feats.dtype} of shape {tuple(feats.shape)}; expected float32 "
                                f"of shape ({audio.num_mel_bins}, frames)")
    if not 0 < item.audio_len <= feats.shape[1] or feats.shape[1] > item.audio_len + audio.context_frames:
        raise InvalidInputError(f"audio features of {feats.shape[1]} frames for {item.audio_len} valid frames")
    if audio_output_tokens(item.audio_len) != item.num_tokens:
        raise InvalidInputError(f"{item.audio_len} audio frames make {audio_output_tokens(item.audio_len)} tokens, "
                                f"not {item.num_tokens}")
