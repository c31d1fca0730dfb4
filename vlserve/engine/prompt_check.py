"""The engine checks every prompt it admits, whoever built it (the front-end, an encoder service): a malformed
prompt is refused with a clear error for that request and can never crash the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.model.families import family_of

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
    rows, positions = cfg.model.position_rows, prompt.positions
    if positions.dtype != torch.int64 or tuple(positions.shape) != (rows, length):
        raise InvalidInputError(f"positions are {positions.dtype} of shape {tuple(positions.shape)}; expected int64 "
                                f"of shape ({rows}, {length})")
    if length and int(positions.min()) < 0:
        raise InvalidInputError("positions must not be negative")
    if prompt.block_rows is not None:
        if block_capacity is None:
            raise InvalidInputError("this engine has no receive buffers; the prompt's rows cannot be read")
        num_blocks, block_tokens = block_capacity
        rows = prompt.rows_in_blocks
        if len(prompt.block_rows) * block_tokens < rows or any(not 0 <= b < num_blocks for b in prompt.block_rows):
            raise InvalidInputError(f"the prompt's receive blocks do not hold its {rows} rows")
    width = cfg.model.embedding_width
    family = family_of(cfg.model.architecture)
    check_item = family.load(family.check_item)
    previous_end = 0
    for item in prompt.mm_items:
        if item.modality not in cfg.model.modalities:
            raise InvalidInputError(f"a {item.modality!r} item; this model takes {', '.join(cfg.model.modalities)}")
        check_item(item, cfg.model)  # the family's: its grid and encoder input make its token count
        if item.offset < previous_end or item.end > length:
            raise InvalidInputError("media items overlap or run past the end of the prompt")
        previous_end = item.end
        sources = sum(x is not None for x in (item.pixel_values, item.audio_features, item.embeddings))
        if sources > 1:
            raise InvalidInputError("a media item has more than one of pixel values, audio features and embeddings")
        if sources == 0 and prompt.block_rows is None:
            raise InvalidInputError("a media item needs pixel values, audio features, embeddings or rows in "
                                    "receive blocks")
        if item.needs_encoder and not cfg.load_vision:
            raise InvalidInputError("this engine has no media encoder; media must arrive as embeddings")
        if item.embeddings is not None and (not item.embeddings.is_floating_point()
                                            or tuple(item.embeddings.shape) != (item.num_tokens, width)):
            raise InvalidInputError(f"embeddings are {item.embeddings.dtype} of shape {tuple(item.embeddings.shape)}; "
                                    f"expected floats of shape ({item.num_tokens}, {width})")

