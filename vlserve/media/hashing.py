"""Content hashes of multimodal items (mm_hash): the key of the encoder cache and part of prefix-cache keys.

The hash covers the decoded pixels (so the same picture sent as a URL, base64 or a file hits the same entry)
plus every preprocessing parameter that changes the encoder's output.
"""

from __future__ import annotations

import json

import blake3
from PIL import Image


def hash_image(img: Image.Image, params: dict) -> str:
    h = blake3.blake3()
    h.update(f"image|{img.mode}|{img.width}x{img.height}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    h.update(img.tobytes())
    return h.hexdigest(length=16)


def hash_user_id(uuid: str, params: dict) -> str:
    """A caller-provided id stands in for the content (vLLM's `uuid` convention); params still matter."""
    h = blake3.blake3(f"uuid|{uuid}|".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest(length=16)
