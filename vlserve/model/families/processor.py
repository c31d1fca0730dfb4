"""A family's request path (its `MultiModalProcessor`): what a prompt's media become (tower inputs, token counts,
content hashes), how its placeholders expand, and its positions. The front end's input processor does what is the
same for every family first (tokenizing, the kinds and number of media, uuids, which mm_processor_kwargs are
known) and hands the rest to the model's family; so does an encoder service.

Placeholder expansion and 1-D positions are shared here; each family keeps its own tiling, resizing and
position rules in its folder.
"""

from __future__ import annotations

import contextlib
import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.media.data_url import decode_base64
from vlserve.media.image import ImageBounds
from vlserve.model.config_types import ModelConfig

EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # precomputed embeddings a client may send


@dataclass(frozen=True)
class ProcessorContext:
    """What informs and bounds a family's processing, the same for every prompt of a server."""

    model: ModelConfig
    model_path: Path
    tokenizer: Any  # the checkpoint's (transformers) tokenizer
    dtype: torch.dtype  # what the engine computes in (precomputed embeddings are cast to it)
    max_model_len: int
    # The most embedding tokens one media item may take, and the option that sets it (the encoder's per-step
    # budget, its cache, the context): an item over it is refused before its pixels are resized.
    item_token_limit: tuple[str, int]
    max_image_pixels: int  # a picture or video frame, as decoded and as resized (--max-image-pixels)
    max_video_frames: int
    enable_mm_embeds: bool
    max_audio_seconds: float
    max_media_bytes: int
    max_video_bytes: int
    processed_cache_bytes: int = 0  # processed media items kept for a re-sent picture or video (0: none)

    def check_item_tokens(self, tokens: int, what: str, hint: str = "send a smaller one") -> None:
        name, limit = self.item_token_limit
        if tokens > limit:
            raise InvalidInputError(f"the {what} would take {tokens} embedding tokens, more than the {limit} one item "
                                    f"may take here ({name}); {hint}")


@dataclass
class PromptMedia:
    """One prompt as the family receives it: tokenized, its media counted and bounded."""

    text: str | None  # None when the prompt came as token ids
    token_ids: list[int]
    media: dict[str, list[tuple[Any, str | None]]]  # kind -> [(source, the client's uuid or None)], in order
    mm_kwargs: dict  # mm_processor_kwargs, only names in the processor's `mm_kwargs`
    from_token_ids: bool  # the client sent token ids (a family that rewrites the prompt rewrites those)
    tokenize: Callable[[str], list[int]]  # the front end's tokenizer, with its bounds (a family that rewrites text)


@dataclass
class MediaItem:
    """One processed picture, video (or part of one) before its placeholder is placed: what a family's
    processor makes of a media source, cached as is (`MediaItemCache`) and placed at its offset per prompt."""

    num_tokens: int
    layout: tuple[int, int, int]  # the family's three numbers (its checks and tower read them)
    mm_hash: str
    modality: str = "image"
    pixel_values: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    audio_features: torch.Tensor | None = None
    audio_len: int = 0

    def placed_at(self, offset: int) -> MultiModalItem:
        return MultiModalItem(offset, self.num_tokens, self.pixel_values, self.layout, self.mm_hash,
                              self.embeddings, self.modality, self.audio_features, self.audio_len)


_KEY_SLICE = 1 << 20  # characters of a data URL encoded at a time for its cache key


class NotLaidOut(Exception):
    """`MediaItemCache.only_cached`: an item whose layout is not cached yet (it would need a decode)."""


def item_nbytes(item: Any) -> int:
    """Bytes of the tensors a processed item holds (what a cache of processed items is bounded by)."""
    values = item if isinstance(item, tuple) else (item,)
    total = 0
    for value in values:
        for part in value if isinstance(value, list) else [value]:
            for name in ("pixel_values", "audio_features", "embeddings"):
                t = getattr(part, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total + 256  # the item's own fields


class MediaItemCache:
    """Media items by a hash of the item's raw source (data URL text or fetched bytes) and the settings: a picture
    sent again, as every turn of a chat resends it, costs one blake3 pass over its bytes instead of a decode and a
    resize. Two uses: layouts (token counts, grids, content hashes; no pixels: a router's need), bounded by count,
    and processed items (pixels too: a server's), bounded by bytes (`weigh`). Least recently used out; thread-safe.
    Inside `only_cached()` (on this thread) an item not cached raises NotLaidOut instead of being made."""

    def __init__(self, size: int = 1024, weigh: Callable[[Any], int] | None = None):
        self.size, self.hits, self.misses = size, 0, 0
        self.weigh = weigh or (lambda _: 1)
        self.weight = 0
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()

    @contextlib.contextmanager
    def only_cached(self):
        self._local.only_cached = True
        try:
            yield
        finally:
            self._local.only_cached = False

    @staticmethod
    def key(kind: str, src: Any, settings: Any) -> bytes | None:
        """None for what may change under the same name (a path) or has no bytes of its own (a PIL image)."""
        text = isinstance(src, str) and src[:5].lower() == "data:"
        if not text and not isinstance(src, (bytes, bytearray, memoryview)):
            return None
        h = blake3.blake3(f"{kind}|{json.dumps(settings, sort_keys=True, default=str)}|".encode())
        if text:  # its UTF-8, a slice at a time (no whole copy of a data URL of megabytes)
            for i in range(0, len(src), _KEY_SLICE):
                h.update(src[i:i + _KEY_SLICE].encode())
        else:
            h.update(src)
        return h.digest()

    def get_or_make(self, key: bytes | None, make: Callable[[], Any]) -> Any:
        if key is None or self.size <= 0:
            return make()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return hit[0]
        if getattr(self._local, "only_cached", False):
            raise NotLaidOut
        value = make()  # outside the lock: a decode takes milliseconds
        weight = self.weigh(value)
        with self._lock:
            self.misses += 1
            if weight <= self.size and key not in self._items:
                self._items[key] = (value, weight)
                self.weight += weight
            while self.weight > self.size:
                self.weight -= self._items.popitem(last=False)[1][1]
        return value


class MultiModalProcessor(ABC):
    # mm_processor_kwargs this family reads (any other name is refused before the family sees the prompt)
    mm_kwargs: frozenset[str] = frozenset()
    # What this family's processing refuses of a picture's (or video frame's) shape whatever else it is: each
    # side at most `max_image_side` pixels, the long side at most `max_image_aspect_ratio` times the short one
    # (None: no bound). Declared here, they are checked with the server's pixel cap from the header, before any
    # decoding (`image_bounds`, vlserve.media.image.ImageBounds).
    max_image_side: int | None = None
    max_image_aspect_ratio: float | None = None

    def __init__(self, ctx: ProcessorContext):
        self.ctx = ctx
        self.layouts = MediaItemCache()
        # Processed items (pixels, features) of pictures and videos sent again, bounded by --mm-processor-cache-gb.
        self.processed = MediaItemCache(ctx.processed_cache_bytes, weigh=item_nbytes)
        self.image_bounds = ImageBounds(ctx.max_image_pixels, self.max_image_side, self.max_image_aspect_ratio)

    @abstractmethod
    def process(self, prompt: PromptMedia) -> ProcessedPrompt:
        """Load and preprocess the media (decode, bound, resize, hash), expand placeholders, positions. Raises
        InvalidInputError (or a subclass) for anything the client can fix."""

    def max_frames(self, kwargs: dict) -> int:
        """A request's `max_frames` (mm_processor_kwargs), at most --max-video-frames; that cap when not given."""
        cap = self.ctx.max_video_frames
        v = kwargs.get("max_frames")
        if v is None:
            return cap
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidInputError(f"max_frames must be a positive integer, got {v!r}")
        if v > cap:
            raise InvalidInputError(f"max_frames {v} exceeds the server's limit of {cap} (--max-video-frames)")
        return v

    def layout(self, prompt: PromptMedia) -> ProcessedPrompt:
        """What `process` gives less the encoder inputs: the same token ids and items (offsets, token counts,
        grids, content hashes) with no pixel values or features, so the same block hashes (a router's need).
        A family may skip resizing and patchifying here, and look re-sent items up in `self.layouts`; by
        default this is `process`."""
        return self.process(prompt)


def expand_placeholders(token_ids: Sequence[int], pad_token_id: int,
                        num_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Replace the k-th `pad_token_id` by `num_tokens[k]` copies of it.

    Returns the expanded ids and, for each item, the index of its first copy in them.
    """
    ids, offsets = expand_all_placeholders(token_ids, {pad_token_id: num_tokens})
    return ids, offsets[pad_token_id]


def expand_all_placeholders(
    token_ids: Sequence[int], num_tokens: dict[int, Sequence[int | list[int]]]
) -> tuple[list[int], dict[int, list[int]]]:
    """Several kinds at once (image and video pads interleaved): the k-th pad of kind `pad_id` becomes
    `num_tokens[pad_id][k]` copies, or that list of ids when it is a list (an Omni video heard with its sound).
    Returns the expanded ids and where each kind's k-th replacement starts in them."""
    wanted = {pad: list(ns) for pad, ns in num_tokens.items()}
    found = {pad: sum(1 for tok in token_ids if tok == pad) for pad in wanted}
    for pad, ns in wanted.items():
        if found[pad] != len(ns):
            raise InvalidInputError(
                f"prompt has {found[pad]} placeholder token(s) (id {pad}) but {len(ns)} media item(s) were provided"
            )
    out: list[int] = []
    offsets: dict[int, list[int]] = {pad: [] for pad in wanted}
    prev = 0
    for pos, tok in enumerate(token_ids):
        if tok not in wanted:
            continue
        n = wanted[tok][len(offsets[tok])]
        replacement = n if isinstance(n, list) else [tok] * n
        if not replacement:
            raise InvalidInputError(f"a media item must occupy at least one token, got {n}")
        out.extend(token_ids[prev:pos])  # slices keep the whole thing O(len(output))
        offsets[tok].append(len(out))
        out.extend(replacement)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return out, offsets


def rope_positions(length: int) -> tuple[torch.Tensor, int]:
    """Ordinary 1-D positions: one row [1, length] (`ModelConfig.position_rows` of a plain-RoPE model); delta 0."""
    return torch.arange(length)[None], 0


def decode_embeds(value: Any) -> torch.Tensor:
    """A tensor as is; a string as base64 of a safetensors file holding one tensor (never a pickle)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if not isinstance(value, str):
        raise InvalidInputError("image_embeds must be a tensor or base64 of a safetensors file")
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(decode_base64(value))
    except (InvalidInputError, ValueError, SafetensorError) as e:
        raise InvalidInputError(f"image_embeds is not base64 of a safetensors file ({type(e).__name__})") from None
    if len(tensors) != 1 and "image_embeds" not in tensors:
        raise InvalidInputError(f"image_embeds safetensors must hold one tensor (or one named 'image_embeds'), "
                                f"got {sorted(tensors)[:5]}")
    return tensors.get("image_embeds", next(iter(tensors.values())))
