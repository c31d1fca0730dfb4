"""The parsed form of a checkpoint's config.json, the same for every model family: small frozen dataclasses that
cross processes as typed messages, and the helpers family parsers share (vlserve.model.families.*.config)."""

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


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    sparse_step: int  # every `sparse_step`-th layer is sparse ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: a shared expert gated by sigmoid (0: none)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequencies stretched for longer contexts (a Llama config's `rope_parameters` / `rope_scaling`):
    "linear" divides every frequency by `factor`; "llama3" divides the low ones by it, keeps the high ones and
    blends in between (wavelengths between original_max_position_embeddings / high_freq_factor and / low_freq_factor).
    """

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Qwen3.5's Gated DeltaNet layers: a causal depthwise conv over q, k, v, then the gated delta rule."""

    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: q and k (key heads) then v (value heads)."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


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
    # How the rotary frequencies (rotary_dim / 2) split among the rows of `[k, n]` positions: section i follows
    # row i ((n, 0, 0): every frequency follows row 0, plain RoPE). config.json's `mrope_section` for Qwen.
    rotary_sections: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2: biased q/k/v projections; Qwen3: none
    rotary_interleaved: bool = False  # the sections' frequencies cycle rows 0, 1, 2 instead of coming in bands (Qwen3)
    hidden_act: str = "silu"
    moe: MoEConfig | None = None
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (every Qwen model)
    # Qwen3.5's hybrid decoder: per layer "linear_attention" or "full_attention"; () = every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # full attention's output * sigmoid(gate), the gate from q_proj

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: every layer but the linear-attention ones."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
    # Tower blocks whose outputs become a media token's side rows (`ModelConfig.side_rows`), in order: Qwen3-VL's
    # DeepStack levels, which feed the LM's first layers.
    side_row_layers: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class AudioConfig:
    """A Whisper-style audio tower: conv stem (stride 2), pre-LN transformer layers, average pooling by 2, final
    LayerNorm, a projection to the LM width (Qwen2-Audio's multi_modal_projector; Omni's `proj`)."""

    num_mel_bins: int
    d_model: int
    layers: int
    heads: int
    ffn_dim: int
    max_source_positions: int  # rows of the position table (after the stride-2 conv)
    output_dim: int  # width handed to the LM
    # Feature frames after the valid ones the tower's convolutions read (the front end sends them): Qwen2-Audio
    # runs on the extractor's padded features, so its last valid outputs see 2 frames past the sound; Omni's
    # tower reads valid frames only.
    context_frames: int
    activation: str = "gelu"
    # Qwen2-Audio: a learned position table over the whole clip (from the checkpoint). Omni (n_window > 0): the
    # features are cut into chunks of 2 * n_window frames, each convolved, positioned (sinusoids, computed) and
    # attended on its own.
    n_window: int = 0
    # Omni's M-RoPE (frontend positions, not the tower): temporal positions per second of audio or video, and
    # the seconds per chunk a video's frames and sound interleave by.
    position_id_per_seconds: float = 25.0
    seconds_per_chunk: float = 2.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def learned_positions(self) -> bool:
        return self.n_window == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig | None  # None: the model sees no pictures (Qwen2-Audio)
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None  # dtype named in config.json ("bfloat16", ...), used by dtype="auto"
    transformers_major: int | None = None  # major version that saved it (tie-breaks tensor layouts)
    quantization: tuple[tuple[str, QuantValue], ...] = ()  # the checkpoint's quantization_config, items sorted
    audio: AudioConfig | None = None  # None: the model hears nothing (the Qwen-VL families)
    audio_token_id: int = -1  # the placeholder of an audio item's tokens (-1: none)
    audio_start_token_id: int = -1  # <|audio_bos|> / Omni's audio start (-1: none)
    audio_end_token_id: int = -1
    family: str = ""  # the model family that parsed it (vlserve.model.families)
    # How the family makes prompt positions (its processor reads it): "rope" (ordinary 1-D positions, one row) or
    # the family's own kind (Qwen: M-RoPE's t/h/w rows for media, Omni's with audio).
    position_kind: str = "rope"
    video_rules: str = ""  # how its family samples and lays out videos (its processor reads it)
    # Settings only the family's own code reads (LLaVA: grid pinpoints, feature layer, ...): sorted items, hashable,
    # so the config crosses processes as a typed message and comes back equal.
    family_settings: tuple[tuple[str, QuantValue], ...] = ()

    def setting(self, name: str, default: QuantValue = None) -> QuantValue:
        return next((v for k, v in self.family_settings if k == name), default)

    @property
    def position_rows(self) -> int:
        """Rows of a prompt's positions (`ProcessedPrompt.positions`): one per rotary axis the decoder reads, 3 for
        M-RoPE's t/h/w, 1 when every frequency follows the first axis (plain RoPE)."""
        section = self.text.rotary_sections
        return len(section) if any(section[1:]) else 1

    @property
    def is_hybrid(self) -> bool:
        """Some decoder layers are linear attention (Qwen3.5): they keep a per-sequence state, not a KV cache."""
        t = self.text
        return any(t.is_linear_layer(i) for i in range(t.num_layers))

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds the model takes, among "image", "video", "audio"."""
        return (("image", "video") if self.vision is not None else ()) + (("audio",) if self.audio is not None else ())

    @property
    def side_rows(self) -> int:
        """Rows the encoder makes per media token beside its embedding, which the decoder reads on its own
        (Qwen3-VL: one per DeepStack level; 0 for every other family)."""
        return len(self.vision.side_row_layers) if self.vision is not None else 0

    @property
    def rows_per_media_token(self) -> int:
        """Hidden-size rows the encoder produces per media token: the embedding, then its side rows."""
        return 1 + self.side_rows

    @property
    def embedding_width(self) -> int:
        """Columns of one media token's encoder output (its rows side by side)."""
        return self.text.hidden_size * self.rows_per_media_token

    @property
    def kv_row_width(self) -> int:
        """Columns of one token's KV across every layer with a KV cache (what a prefill instance sends per prompt
        token)."""
        t = self.text
        return t.num_kv_layers * 2 * t.num_kv_heads * t.head_dim


def require(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ModelLoadError(f"config.json: missing '{key}' in {where}")
    return d[key]


def eos_ids(raw: dict, folder: Path) -> tuple[int, ...]:
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


def transformers_major(raw: dict) -> int | None:
    version = str(raw.get("transformers_version", ""))
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float))


def quantization_items(raw: dict) -> tuple[tuple[str, QuantValue], ...]:
    """The checkpoint's quantization_config (top level, or the text config's), hashable; () when unquantized.
    Nested objects and lists of lists are left out: no quantizer here reads one."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ModelLoadError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    items = []
    for key, value in qc.items():
        if isinstance(value, list) and all(map(is_scalar, value)):
            items.append((key, tuple(value)))
        elif is_scalar(value):
            items.append((key, value))
    return tuple(sorted(items))


def token_id(raw: dict, *keys: str, default: int) -> int:
    return next((int(raw[k]) for k in keys if raw.get(k) is not None), default)
