"""A prompt after input processing: token ids with every media placeholder expanded, the media items, and the
positions. Produced by a prompt encoder (local or remote), consumed by the engine; not a request yet."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from vlserve.core.lora import AdapterRef

# Every kind of media a prompt may carry (a model takes some of them: `ModelConfig.modalities`).
MEDIA_KINDS = ("image", "video", "audio")


def media_kinds_needed(media: dict, mm_kwargs: dict | None, modalities) -> frozenset[str]:
    """The kinds of tower output a prompt's media need: their own kinds, and audio for a video heard with its
    sound (`use_audio_in_video`) when the model hears (`modalities`: the model's; else the flag is refused)."""
    kinds = {kind for kind, items in media.items() if items}
    if "video" in kinds and (mm_kwargs or {}).get("use_audio_in_video") is True and "audio" in modalities:
        kinds.add("audio")
    return frozenset(kinds)


@dataclass
class MultiModalItem:
    """One picture, video or sound of a prompt, already preprocessed; its placeholder run is already expanded.

    Its embeddings come from one of: `pixel_values` (the engine runs the vision tower on them), `audio_features`
    (the audio tower), `embeddings` (precomputed), or none: then the prompt's `block_rows` hold them from row
    `media_row(index)` on (received from an encoder service).
    """

    offset: int  # index of the first placeholder token in the prompt
    num_tokens: int  # placeholder length = number of embeddings the encoder produces
    pixel_values: torch.Tensor | None  # [patches, patch_dim]
    # The family's three numbers for the item, opaque outside it (its processor makes them, its checks and towers
    # read them): Qwen's patches (t, h, w), LLaVA's and InternVL's tiles or frames and the picture's size
    layout: tuple[int, int, int]
    # Content hash (encoder-cache key, part of prefix-cache keys). Unknown content gets a unique id, so
    # items without a hash are never shared by mistake.
    mm_hash: str = field(default_factory=lambda: uuid.uuid4().hex)
    embeddings: torch.Tensor | None = None  # [num_tokens, hidden]: the encoder is skipped
    modality: str = "image"  # "image", "video" or "audio"
    # [n_mels, frames] log-mel features the audio tower reads: the valid frames, then the feature extractor's
    # padding frames its convolution also reads (`AudioConfig.context_frames`)
    audio_features: torch.Tensor | None = None
    audio_len: int = 0  # valid frames of `audio_features`

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def needs_encoder(self) -> bool:
        return self.pixel_values is not None or self.audio_features is not None


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem]
    # [k, len(prompt_token_ids)] int64: one row per rotary axis the decoder reads (`ModelConfig.position_rows`:
    # 1 for plain RoPE, 3 for M-RoPE's t/h/w), made by the model's family
    positions: torch.Tensor
    position_delta: int  # a generated token's position is its index + this (M-RoPE compresses media positions)
    text: str | None = None  # the prompt text, when there was one (returned to users as RequestOutput.prompt)
    # Receive blocks (engine.transfer_buffers) holding rows a peer sent: media rows from an encoder service, item
    # after item (items without pixel values or embeddings read theirs from here, in place), or with
    # `kv_in_blocks` every prompt token's KV row from a prefill instance.
    block_rows: list[int] | None = None
    kv_in_blocks: bool = False
    lora: AdapterRef | None = None  # the LoRA adapter it runs with (its KV, and its media rows if it adapts towers)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def media_row(self, index: int) -> int:
        """The receive row where item `index`'s media rows start: after the rows of the items before it."""
        return sum(item.num_tokens for item in self.mm_items[:index])

    @property
    def rows_in_blocks(self) -> int:
        """How many rows `block_rows` hold for this prompt."""
        return self.num_tokens if self.kv_in_blocks else self.media_row(len(self.mm_items))
