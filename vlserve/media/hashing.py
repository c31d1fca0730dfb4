"""Content hashes of multimodal items (mm_hash): the key of the encoder cache and part of prefix-cache keys.

The hash covers the decoded pixels (so the same picture sent as a URL, base64 or a file hits the same entry)
plus every preprocessing parameter that changes the encoder's output.
"""

from __future__ import annotations

import json

import blake3
import numpy as np
import torch
from PIL import Image

HASH_BAND_BYTES = 1 << 20  # a picture is hashed a band of rows of about this many bytes at a time


def hash_image(img: Image.Image, params: dict) -> str:
    """The pixels are hashed as `img.tobytes()` would give them, a band of rows at a time: no whole copy of a big
    picture is made, and no single call holds the GIL for all of it (this runs beside the server's event loop)."""
    h = blake3.blake3()
    h.update(f"image|{img.mode}|{img.width}x{img.height}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    rows = max(1, HASH_BAND_BYTES // max(1, img.width * len(img.getbands())))
    for top in range(0, img.height, rows):
        band = img if rows >= img.height else img.crop((0, top, img.width, min(img.height, top + rows)))
        h.update(band.tobytes())
    return h.hexdigest(length=16)


def hash_audio(waveform, sample_rate: int, params: dict) -> str:
    """The decoded clip (mono float32 at the model's rate: the same sound sent as wav, flac or an array at that
    rate hits the same entry) plus the feature settings that shape what the encoder gets."""
    samples = np.ascontiguousarray(waveform, dtype=np.float32)
    h = blake3.blake3()
    h.update(f"audio|{sample_rate}|{samples.size}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    h.update(memoryview(samples).cast("B"))
    return h.hexdigest(length=16)


def hash_user_id(uuid: str, params: dict) -> str:
    """A caller-provided id stands in for the content (vLLM's `uuid` convention); params still matter."""
    h = blake3.blake3(f"uuid|{uuid}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest(length=16)


def hash_video(frames: list, params: dict) -> str:
    """The sampled frames (what the encoder sees before resizing) plus the settings that shaped them."""
    h = blake3.blake3()
    h.update(f"video|{len(frames)}|{frames[0].shape}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    for f in frames:
        h.update(memoryview(f.tobytes()))
    return h.hexdigest(length=16)


def hash_video_patch(video_hash: str, index: int) -> str:
    """One temporal patch of a hashed video (Qwen3-VL encodes and caches each patch as its own item)."""
    return blake3.blake3(f"video-patch|{video_hash}|{index}".encode()).hexdigest(length=16)


def hash_window(item_hash: str, start: int, end: int) -> str:
    """Part [start, end) of a hashed item (an Omni video heard with its sound: frames or audio tokens of one
    2-second window, each encoded and cached as its own item)."""
    return blake3.blake3(f"window|{item_hash}|{start}|{end}".encode()).hexdigest(length=16)


def hash_embeddings(embeds, layout: tuple[int, int, int]) -> str:
    """Precomputed embeddings are their own content: equal tensors share encoder and prefix cache entries."""
    h = blake3.blake3(f"embeds|{tuple(layout)}|{embeds.dtype}|{tuple(embeds.shape)}|".encode())
    h.update(memoryview(embeds.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest(length=16)
