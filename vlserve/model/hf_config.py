"""Read a Hugging Face `config.json` of a Qwen2-VL family model into small frozen dataclasses.

Two formats exist in the wild and both are accepted:
- transformers >= 5 nests the language model under `text_config` and names RoPE settings `rope_parameters`;
- the original hub checkpoints keep text fields at the top level with `rope_scaling` / `rope_theta`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlserve.core.errors import ModelLoadError


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        # Qwen2-VL derives head_dim from hidden/heads and ignores any `head_dim` key.
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    width: int  # ViT hidden width (Qwen2-VL: embed_dim, Qwen2.5-VL: hidden_size)
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    out_dim: int  # width of the merged tokens handed to the LM
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float
    window_size: int  # 0 = no window attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...]
    tokens_per_second: float
    # Qwen2.5-VL spaces video frames on the temporal M-RoPE axis by real time (second_per_grid_t *
    # tokens_per_second); Qwen2-VL by one position per merged frame.
    time_scaled_video: bool = False

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None  # dtype named in config.json ("bfloat16", ...), used by dtype="auto"


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ModelLoadError(f"config.json: missing '{key}' in {where}")
    return d[key]


def _text_config(raw: dict) -> TextConfig:
    t = raw.get("text_config") or raw  # nested (transformers 5) or flat (original hub format)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", t.get("rope_theta", raw.get("rope_theta", 1000000.0)))
    hidden = _require(t, "hidden_size", "text config")
    heads = _require(t, "num_attention_heads", "text config")
    section = tuple(rope.get("mrope_section", (16, 24, 24)))
    head_dim = hidden // heads
    if sum(section) != head_dim // 2:
        raise ModelLoadError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=_require(t, "vocab_size", "text config"),
        hidden_size=hidden,
        intermediate_size=_require(t, "intermediate_size", "text config"),
        num_layers=_require(t, "num_hidden_layers", "text config"),
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        mrope_section=section,
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(tie),
    )


def _vision_config(raw: dict, architecture: str, text: TextConfig) -> VisionConfig:
    v = _require(raw, "vision_config", "config.json")
    windowed = architecture == "Qwen2_5_VLForConditionalGeneration"
    if windowed:  # Qwen2.5-VL: RMSNorm + SwiGLU blocks, window attention, explicit out_hidden_size
        width = v.get("hidden_size", 1280)
        mlp_hidden = v.get("intermediate_size", 3420)
        out_dim = v.get("out_hidden_size", text.hidden_size)
        act = v.get("hidden_act", "silu")
    else:  # Qwen2-VL: LayerNorm + GELU blocks; `hidden_size` is the merger's output width
        width = v.get("embed_dim", 1280)
        mlp_hidden = int(width * v.get("mlp_ratio", 4))
        out_dim = v.get("hidden_size", text.hidden_size)
        act = v.get("hidden_act", "quick_gelu")
    if out_dim != text.hidden_size:
        raise ModelLoadError(f"vision output width {out_dim} != language model hidden size {text.hidden_size}")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=v.get("depth", 32),
        width=width,
        num_heads=v.get("num_heads", 16),
        mlp_hidden=mlp_hidden,
        hidden_act=act,
        out_dim=out_dim,
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=v.get("window_size", 112) if windowed else 0,
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if windowed else (),
        tokens_per_second=float(v.get("tokens_per_second", 2)),
        time_scaled_video=windowed,
    )


def _eos_ids(raw: dict, folder: Path) -> tuple[int, ...]:
    """EOS ids come from generation_config.json when present (chat models stop on <|im_end|>)."""
    ids: list[int] = []
    gen_path = folder / "generation_config.json"
    sources = [json.loads(gen_path.read_text())] if gen_path.is_file() else []
    sources += [raw, raw.get("text_config") or {}]
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else list(eos)
        if ids:
            break
    return tuple(int(i) for i in ids)


def parse_model_config(raw: dict, folder: Path) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; cannot tell which model to build")
    architecture = archs[0]
    text = _text_config(raw)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    return ModelConfig(
        architecture=architecture,
        text=text,
        vision=_vision_config(raw, architecture, text),
        image_token_id=raw.get("image_token_id", 151655),
        video_token_id=raw.get("video_token_id", 151656),
        vision_start_token_id=raw.get("vision_start_token_id", 151652),
        vision_end_token_id=raw.get("vision_end_token_id", 151653),
        eos_token_ids=_eos_ids(raw, folder),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
    )


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    return parse_model_config(raw, folder)
