"""Engine arguments (the offline `LLM(**kwargs)` and the CLI flags share them) resolved once into a config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlserve.errors import InvalidInputError
from vlserve.models.hf_config import ModelConfig, load_model_config
from vlserve.models.loader import resolve_dtype, resolve_model_path

DEFAULT_KV_CACHE_GB = 2.0
DEFAULT_MM_LIMITS = {"image": 8, "video": 1}  # kinds a user does not name keep these


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    device: str = "auto"  # auto -> cuda when available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 16384
    max_num_encoder_input_tokens: int = 16384
    disable_chunked_mm_input: bool = False
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MM_LIMITS))
    max_video_frames: int = 32
    enable_mm_embeds: bool = False
    seed: int = 0
    load_vision: bool = True  # False on a disaggregated language server (not a CLI flag)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class VlserveConfig:
    """Everything the engine needs, resolved: paths, dtype, device and cache sizes are final here."""

    model_path: Path
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    encoder_cache_size: int
    max_num_encoder_input_tokens: int
    disable_chunked_mm_input: bool
    limit_mm_per_prompt: dict[str, int]
    max_video_frames: int
    enable_mm_embeds: bool
    seed: int
    load_vision: bool

    @property
    def kv_bytes_per_token(self) -> int:
        t = self.model.text
        return 2 * t.num_layers * t.num_kv_heads * t.head_dim * torch.empty((), dtype=self.dtype).element_size()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise InvalidInputError(f"{name} must be positive, got {value}")


def resolve_config(args: EngineArgs) -> VlserveConfig:
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                 "kv_cache_memory_gb", "max_video_frames"):
        _positive(name, getattr(args, name))
    if args.encoder_cache_size < 0 or args.max_num_encoder_input_tokens <= 0:
        raise InvalidInputError("encoder_cache_size must be >= 0 and max_num_encoder_input_tokens > 0")
    path = resolve_model_path(args.model)
    model_cfg = load_model_config(path)
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, model_cfg, device)
    max_model_len = args.max_model_len or min(model_cfg.text.max_position_embeddings, 32768)
    partial = dict(
        model_path=path, model=model_cfg, dtype=dtype, device=device, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        encoder_cache_size=args.encoder_cache_size, max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        disable_chunked_mm_input=args.disable_chunked_mm_input, limit_mm_per_prompt={**DEFAULT_MM_LIMITS, **args.limit_mm_per_prompt},
        max_video_frames=args.max_video_frames, enable_mm_embeds=args.enable_mm_embeds, seed=args.seed,
        load_vision=args.load_vision,
    )
    cfg = VlserveConfig(num_kv_blocks=1, **partial)
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        # Without an explicit size, take the default budget but never more than every sequence at full length.
        gb = args.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB
        num_blocks = int(gb * 2**30) // (cfg.kv_bytes_per_token * args.block_size)
        if args.kv_cache_memory_gb is None:
            cap = args.max_num_seqs * -(-max_model_len // args.block_size)
            num_blocks = min(num_blocks, cap)
    if num_blocks < 2:
        raise InvalidInputError(f"KV cache too small: {num_blocks} blocks; raise kv_cache_memory_gb or num_kv_blocks")
    return dataclasses.replace(cfg, num_kv_blocks=num_blocks)
