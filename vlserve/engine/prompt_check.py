"""The engine checks every prompt it admits, whoever built it (the front-end, an encoder service): a malformed
prompt is refused with a clear error for that request and can never crash the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import ProcessedPrompt

if TYPE_CHECKING:  # a front end checks what its peers assembled too, without the engine's config module
    from vlserve.engine.config import VlserveConfig


def check_prompt(prompt: ProcessedPrompt, cfg: VlserveConfig, block_capacity: tuple[int, int] | None = None) -> None:
    """`cfg`: the engine's config, or a front end's (anything with its `model` and `load_vision`).
    `block_capacity`: (blocks, tokens per block) of the receive buffers this engine reads, if any."""
    ids, vocab = prompt.prompt_token_ids, cfg.model.text.vocab_size
    if not ids:
        raise InvalidInputError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise InvalidInputError(f"the prompt holds token ids outside the vocabulary (0..{vocab - 1})")
    length = len(ids)
    if prompt.mrope_positions.dtype != torch.int64 or tuple(prompt.mrope_positions.shape) != (3, length):
        raise InvalidInputError(f"M-RoPE positions are {prompt.mrope_positions.dtype} of shape "
                                f"{tuple(prompt.mrope_positions.shape)}; expected int64 of shape (3, {length})")
    if length and int(prompt.mrope_positions.min()) < 0:
        raise InvalidInputError("M-RoPE positions must not be negative")
    if prompt.block_rows is not None:
        if block_capacity is None:
            raise InvalidInputError("this engine has no receive buffers; the prompt's rows cannot be read")
        num_blocks, block_tokens = block_capacity
        rows = prompt.rows_in_blocks
        if len(prompt.block_rows) * block_tokens < rows or any(not 0 <= b < num_blocks for b in prompt.block_rows):
            raise InvalidInputError(f"the prompt's receive blocks do not hold its {rows} rows")
    merge = cfg.model.vision.spatial_merge_size
    width = cfg.model.embedding_width
    patch_dim = cfg.model.vision.patch_dim
    previous_end = 0
    for item in prompt.mm_items:
        t, h, w = item.grid_thw
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise InvalidInputError(f"grid_thw {item.grid_thw} must be positive with h, w divisible by {merge}")
        if item.num_tokens != t * h * w // merge**2:
            raise InvalidInputError(f"a media item of grid {item.grid_thw} takes {t * h * w // merge**2} tokens, "
                                    f"not {item.num_tokens}")
        if item.offset < previous_end or item.end > length:
            raise InvalidInputError("media items overlap or run past the end of the prompt")
        previous_end = item.end
        if item.pixel_values is not None and item.embeddings is not None:
            raise InvalidInputError("a media item has both pixel values and embeddings")
        if item.pixel_values is None and item.embeddings is None and prompt.block_rows is None:
            raise InvalidInputError("a media item needs pixel values, embeddings or rows in receive blocks")
        if item.pixel_values is not None:
            if not cfg.load_vision:
                raise InvalidInputError("this engine has no vision encoder; media must arrive as embeddings")
            if tuple(item.pixel_values.shape) != (t * h * w, patch_dim):
                raise InvalidInputError(f"pixel values of shape {tuple(item.pixel_values.shape)} do not match grid "
                                        f"{item.grid_thw}")
        elif item.embeddings is not None and (not item.embeddings.is_floating_point()
                                              or tuple(item.embeddings.shape) != (item.num_tokens, width)):
            raise InvalidInputError(f"embeddings are {item.embeddings.dtype} of shape {tuple(item.embeddings.shape)}; "
                                    f"expected floats of shape ({item.num_tokens}, {width})")
