"""Pixel steps every family's preprocessing shares, computed the way transformers' processors compute them.

Pictures go through the PIL backend (`pil_resize` of uint8 arrays, then `rescale_normalize`: rescale in float64
then float32, normalize in float32, HF's order). Video frames go through torchvision in transformers (not
installed here): `torch_resize` is what its `resize` does to uint8 frames on CPU (antialiased interpolation of the
uint8 tensor itself for bicubic, and for bilinear where the CPU has AVX2), and `normalize_frames` its fused
rescale-and-normalize.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vlserve.core.errors import ModelLoadError

NEAREST, BILINEAR, BICUBIC = 0, 2, 3  # PIL resample numbers (what preprocessor configs hold)
TORCH_MODES = {NEAREST: "nearest-exact", BILINEAR: "bilinear", BICUBIC: "bicubic"}  # torchvision's mapping


def read_json_object(path: Path) -> dict | None:
    """A settings file as a dict; None when there is none; ModelLoadError when it is not a JSON object."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return raw


def processor_settings(folder: str | Path, kind: str) -> dict:
    """A checkpoint's picture (`kind="image"`) or video processor settings as transformers finds them:
    processor_config.json's `<kind>_processor` entry, then (videos) video_preprocessor_config.json, then
    preprocessor_config.json. ModelLoadError when there are none or a file is not a JSON object."""
    folder = Path(folder)
    nested = (read_json_object(folder / "processor_config.json") or {}).get(f"{kind}_processor")
    raw = nested if isinstance(nested, dict) else None
    names = ["video_preprocessor_config.json", "preprocessor_config.json"] if kind == "video" else \
        ["preprocessor_config.json"]
    for name in names:
        if raw is None:
            raw = read_json_object(folder / name)
    if raw is None:
        raise ModelLoadError(f"{folder}: no {kind} processor settings (preprocessor_config.json)")
    return raw


def channel_values(v: Any) -> tuple[float, float, float]:
    """image_mean / image_std: three numbers, or one for every channel."""
    vals = [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * 3
    if len(vals) != 3:
        raise ValueError(f"expected 3 channel values, got {v!r}")
    return (vals[0], vals[1], vals[2])


def pil_resize(img: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [h, w, 3] with PIL (the same size: the same pixels, as PIL copies)."""
    if img.shape[:2] == size:
        return img
    return np.asarray(Image.fromarray(img).resize((size[1], size[0]), resample=resample))


def rescale_normalize(tiles: np.ndarray, rescale: float | None, mean: Sequence[float] | None,
                      std: Sequence[float] | None) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3 * H * W] (C, H, W order) as the PIL backend computes: rescale in
    float64 then float32 (None: no rescale), normalize in float32 (mean None: none)."""
    x = tiles
    if rescale is not None:
        x = (x.astype(np.float64) * rescale).astype(np.float32)
    x = x.astype(np.float32, copy=False)
    if mean is not None:
        x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    n = x.shape[0]
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).view(n, -1)


def _native_uint8(mode: str) -> bool:
    """torchvision resizes uint8 frames as uint8 on CPU for bicubic, and for bilinear where the CPU has AVX2."""
    if mode == "bilinear":
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return True


def torch_resize(frames: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """uint8 [T, 3, H, W] -> [T, 3, h, w] as torchvision's `resize_image` (antialias=True) on CPU."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    mode = TORCH_MODES[resample]
    smooth = mode in ("bilinear", "bicubic")
    kw = {"align_corners": False, "antialias": True} if smooth else {}
    if _native_uint8(mode):
        return F.interpolate(frames, size=list(size), mode=mode, **kw)
    out = F.interpolate(frames.to(torch.float32), size=list(size), mode=mode, **kw)
    return out.round_().to(torch.uint8)


def normalize_frames(x: torch.Tensor, rescale: float | None, mean: Sequence[float] | None,
                     std: Sequence[float] | None) -> torch.Tensor:
    """uint8 [T, 3, H, W] -> float32 [T, 3 * H * W]: torchvision's fused (x - mean / r) / (std / r) in float32."""
    if mean is not None:
        m, s = torch.tensor(mean), torch.tensor(std)  # float32, as HF builds them
        if rescale is not None:
            m, s = m * (1.0 / rescale), s * (1.0 / rescale)
        x = (x.to(torch.float32) - m.view(-1, 1, 1)) / s.view(-1, 1, 1)
    elif rescale is not None:
        x = x * rescale
    return x.to(torch.float32).contiguous().view(x.shape[0], -1)
