"""Read a Hugging Face `config.json` of a Qwen-VL family model into small frozen dataclasses.

Families (by `architectures`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE. Two formats exist in the wild
and both are accepted:
- transformers >= 5 nests the language model under `text_config` and names RoPE settings `rope_parameters`;
- older checkpoints keep RoPE settings in `rope_scaling` + `rope_theta` (and Qwen2-VL's text fields at the top).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlserve.core.errors import ModelLoadError

# A quantization_config value kept in ModelConfig: a scalar or a flat list of them (typed, so the config crosses
# processes as a msgspec message and comes back equal).
QuantScalar = str | int | float | bool | None
QuantValue = QuantScalar | tuple[QuantScalar, ...]

QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                               "Qwen3VLForConditionalGeneration",
                                               "Qwen3VLMoeForConditionalGeneration")
QWEN3_FAMILY = (QWEN3_VL, QWEN3_VL_MOE)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    sparse_step: int  # every `sparse_step`-th layer is sparse ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2: biased q/k/v projections; Qwen3: none
    mrope_interleaved: bool = False  # Qwen3: frequencies cycle T, H, W instead of coming in three bands
    hidden_act: str = "silu"
    moe: MoEConfig | None = None

    def is_sparse_layer(self, layer: int) -> bool:
        m = self.moe
        return m is not None and layer not in m.dense_layers and (layer + 1) % m.sparse_step == 0


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    width: int  # ViT hidden width (Qwen2-VL: embed_dim, the others: hidden_size)
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
    # tokens_per_second); Qwen2-VL by one position per merged frame; Qwen3-VL writes timestamps as text instead.
    time_scaled_video: bool = False
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square grid of position embeddings, interpolated
    deepstack_indexes: tuple[int, ...] = ()  # Qwen3-VL: ViT blocks whose outputs feed the LM's first layers

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
    transformers_major: int | None = None  # major version that saved it (tie-breaks tensor layouts)
    quantization: tuple[tuple[str, QuantValue], ...] = ()  # the checkpoint's quantization_config, items sorted

    @property
    def rows_per_media_token(self) -> int:
        """Hidden-size rows the encoder produces per media token: the embedding, then one per DeepStack level."""
        return 1 + len(self.vision.deepstack_indexes)

    @property
    def embedding_width(self) -> int:
        """Columns of one media token's encoder output (its rows side by side)."""
        return self.text.hidden_size * self.rows_per_media_token

    @property
    def kv_row_width(self) -> int:
        """Columns of one token's KV across every layer (what a prefill instance sends per prompt token)."""
        t = self.text
        return t.num_layers * 2 * t.num_kv_heads * t.head_dim

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds this model takes (every model here has a vision tower; audio models say more)."""
        return ("image", "video")

    @property
    def video_rules(self) -> str:
        """How videos are sampled, resized and laid out in the prompt ("qwen2" or "qwen3", see
        frontend/media/video.py)."""
        return "qwen3" if self.architecture in QWEN3_FAMILY else "qwen2"

    @property
    def video_timestamps(self) -> bool:
        """Qwen3-VL: every temporal patch of a video is its own vision block after a `<t seconds>` timestamp."""
        return self.video_rules == "qwen3"


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ModelLoadError(f"config.json: missing '{key}' in {where}")
    return d[key]


def _rope(raw: dict, t: dict) -> dict:
    return t.get("rope_parameters") or t.get("rope_scaling") or raw.get("rope_scaling") or {}


def _text_config(raw: dict, architecture: str) -> TextConfig:
    t = raw.get("text_config") or raw  # nested (transformers 5) or flat (original hub format)
    rope = _rope(raw, t)
    qwen3 = architecture in QWEN3_FAMILY
    theta = rope.get("rope_theta", t.get("rope_theta", raw.get("rope_theta", 500000.0 if qwen3 else 1000000.0)))
    hidden = _require(t, "hidden_size", "text config")
    heads = _require(t, "num_attention_heads", "text config")
    # Qwen2-VL derives head_dim from hidden/heads (and ignores any `head_dim` key); Qwen3 states it.
    head_dim = (t.get("head_dim") or hidden // heads) if qwen3 else hidden // heads
    section = tuple(rope.get("mrope_section", (24, 20, 20) if qwen3 else (16, 24, 24)))
    if sum(section) != head_dim // 2:
        raise ModelLoadError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    moe = None
    if architecture == QWEN3_VL_MOE:
        experts = t.get("num_experts", t.get("num_local_experts"))
        if experts is None:
            raise ModelLoadError("config.json: missing 'num_experts' in text config")
        moe = MoEConfig(num_experts=experts,
                        top_k=_require(t, "num_experts_per_tok", "text config"),
                        intermediate_size=_require(t, "moe_intermediate_size", "text config"),
                        sparse_step=t.get("decoder_sparse_step") or 1,
                        dense_layers=tuple(t.get("mlp_only_layers") or ()))
        if not 0 < moe.top_k <= moe.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {moe.top_k} must be within 1..num_experts {moe.num_experts}")
    return TextConfig(
        vocab_size=_require(t, "vocab_size", "text config"),
        hidden_size=hidden,
        intermediate_size=_require(t, "intermediate_size", "text config"),
        num_layers=_require(t, "num_hidden_layers", "text config"),
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        mrope_section=section,
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(tie),
        qkv_bias=not qwen3 or bool(t.get("attention_bias", False)),
        mrope_interleaved=qwen3,  # transformers interleaves for Qwen3-VL whatever the config's flag says
        hidden_act=t.get("hidden_act", "silu"),
        moe=moe,
    )


def _vision_config(raw: dict, architecture: str, text: TextConfig) -> VisionConfig:
    v = _require(raw, "vision_config", "config.json")
    windowed, qwen3 = architecture == QWEN2_5_VL, architecture in QWEN3_FAMILY
    if windowed:  # Qwen2.5-VL: RMSNorm + SwiGLU blocks, window attention, explicit out_hidden_size
        width, mlp_hidden = v.get("hidden_size", 1280), v.get("intermediate_size", 3420)
        out_dim, act = v.get("out_hidden_size", text.hidden_size), v.get("hidden_act", "silu")
    elif qwen3:  # Qwen3-VL: LayerNorm + GELU(tanh) blocks, learned position grid, deepstack mergers
        width, mlp_hidden = v.get("hidden_size", 1152), v.get("intermediate_size", 4304)
        out_dim, act = v.get("out_hidden_size", text.hidden_size), v.get("hidden_act", "gelu_pytorch_tanh")
    else:  # Qwen2-VL: LayerNorm + GELU blocks; `hidden_size` is the merger's output width
        width = v.get("embed_dim", 1280)
        mlp_hidden = int(width * v.get("mlp_ratio", 4))
        out_dim, act = v.get("hidden_size", text.hidden_size), v.get("hidden_act", "quick_gelu")
    if out_dim != text.hidden_size:
        raise ModelLoadError(f"vision output width {out_dim} != language model hidden size {text.hidden_size}")
    rope = v.get("rope_parameters") or {}
    deepstack = tuple(v.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else ()
    depth = v.get("depth", 27 if qwen3 else 32)
    if any(not 0 <= i < depth for i in deepstack) or len(set(deepstack)) != len(deepstack):
        raise ModelLoadError(f"deepstack_visual_indexes {list(deepstack)} must be distinct blocks of 0..{depth - 1}")
    grid = v.get("num_position_embeddings", 2304) if qwen3 else 0
    if qwen3 and int(grid**0.5) ** 2 != grid:
        raise ModelLoadError(f"num_position_embeddings {grid} must be a square (a grid of positions)")
    return VisionConfig(
        depth=depth,
        width=width,
        num_heads=v.get("num_heads", 16),
        mlp_hidden=mlp_hidden,
        hidden_act=act,
        out_dim=out_dim,
        patch_size=v.get("patch_size", 16 if qwen3 else 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=v.get("window_size", 112) if windowed else 0,
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if windowed else (),
        tokens_per_second=float(v.get("tokens_per_second", 2)),
        time_scaled_video=windowed,
        num_position_embeddings=grid,
        deepstack_indexes=deepstack,
    )


def _eos_ids(raw: dict, folder: Path) -> tuple[int, ...]:
    gen_path = folder / "generation_config.json"
    sources = [json.loads(gen_path.read_text())] if gen_path.is_file() else []
    sources += [raw, raw.get("text_config") or {}]
    ids: list[int] = []
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else list(eos)
        if ids:
            break
    return tuple(int(i) for i in ids)


def _transformers_major(raw: dict) -> int | None:
    version = str(raw.get("transformers_version", ""))
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float))


def _quantization_items(raw: dict) -> tuple[tuple[str, QuantValue], ...]:
    """The checkpoint's quantization_config (top level, or the text config's), hashable; () when unquantized.
    Nested objects and lists of lists are left out: no quantizer here reads one."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ModelLoadError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    items = []
    for key, value in qc.items():
        if isinstance(value, list) and all(map(_is_scalar, value)):
            items.append((key, tuple(value)))
        elif _is_scalar(value):
            items.append((key, value))
    return tuple(sorted(items))


def parse_model_config(raw: dict, folder: Path) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; cannot tell which model to build")
    architecture = archs[0]
    text = _text_config(raw, architecture)
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
        transformers_major=_transformers_major(raw),
        quantization=_quantization_items(raw),
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
