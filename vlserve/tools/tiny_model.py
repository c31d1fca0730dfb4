"""Create small random checkpoints of the families listed in tiny_arches.py in the Hugging Face layout, fully
offline.

A family with its own builder (`TinyArch.builder`, a module) gives what is its own through five names:
`tokenizer_spec(arch)` -> (special tokens, chat template, tokenizer attributes naming them, eos token, pad token);
`model_config(arch, size_spec, vocab_size, special token ids, init_range, transformers config class)`;
`generation_ids(arch, ids)` (generation_config.json's bos / eos / pad); `processor_files(arch)` (file name ->
JSON contents); `PROBES` (weights whose std `initializer_range` must have set). The Qwen families are built here.

The weights come from transformers' own model classes, so the folder is exactly what
`from_pretrained` expects; the tokenizer is a freshly trained byte-level BPE (see bpe_tokenizer.py) with the
family's special tokens and chat template. Audio families get a Whisper feature extractor's
preprocessor_config.json (Omni's also holds its image processor's fields).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedModel

from vlserve.core.errors import InvalidInputError
from vlserve.tools.bpe_tokenizer import (
    CHAT_TEMPLATE,
    OMNI_CHAT_TEMPLATE,
    OMNI_SPECIAL_TOKENS,
    OMNI_TOKEN_NAMES,
    QWEN2_AUDIO_CHAT_TEMPLATE,
    QWEN2_AUDIO_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    build_tokenizer,
    save_tokenizer,
    special_token_ids,
)
from vlserve.tools import tiny_qwen3_5
from vlserve.tools.tiny_arches import TINY_ARCHES

# arch -> (transformers config class, model class); the families themselves are listed in tiny_arches.py
ARCHES: dict[str, tuple[type, type]] = {
    name: (getattr(transformers, a.config_class), getattr(transformers, a.model_class))
    for name, a in TINY_ARCHES.items()
}
QWEN3 = ("qwen3_vl", "qwen3_vl_moe")
QWEN3_5 = tiny_qwen3_5.QWEN3_5_ARCHES
QWEN3_VISION = QWEN3 + QWEN3_5  # Qwen3-VL's tower, patch size and processor files (Qwen3.5: without DeepStack)
OMNI = ("qwen2_5_omni", "qwen2_5_omni_full")
AUDIO = ("qwen2_audio", *OMNI)
# arch -> (special tokens, chat template, tokenizer attributes naming them)
TOKENIZERS = {"qwen2_audio": (QWEN2_AUDIO_SPECIAL_TOKENS, QWEN2_AUDIO_CHAT_TEMPLATE, None)} | {
    arch: (OMNI_SPECIAL_TOKENS, OMNI_CHAT_TEMPLATE, OMNI_TOKEN_NAMES) for arch in OMNI}


def family_builder(arch: str):
    """The family's own builder module (see the module docstring), None for the Qwen families built here."""
    name = TINY_ARCHES[arch].builder
    return importlib.import_module(name) if name else None

# OpenAI CLIP normalisation, which both Qwen2-VL and Qwen2.5-VL use; Qwen3-VL uses 0.5 / 0.5.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class SizeSpec:
    """Shape of one model size. `vit_*` describe the vision tower; `hidden` etc. the language model."""

    bpe_vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]
    vit_width: int
    vit_heads: int
    vit_depth_2: int  # Qwen2-VL ViT depth
    vit_depth_25: int  # Qwen2.5-VL ViT depth
    vit_intermediate_25: int  # Qwen2.5-VL gated-MLP width (Qwen2-VL uses mlp_ratio 4)
    fullatt_blocks_25: tuple[int, ...]
    max_pixels: int
    dtype: torch.dtype
    init_range: float  # default initializer_range
    tie_embeddings: bool
    vit_depth_3: int  # Qwen3-VL ViT depth
    deepstack_3: tuple[int, ...]  # Qwen3-VL blocks feeding DeepStack
    position_grid_3: int  # Qwen3-VL learned position grid side (num_position_embeddings = side^2)
    experts: tuple[int, int, int]  # Qwen3-VL-MoE: (experts, experts per token, expert intermediate size)
    layers_3: int  # Qwen3-VL LM depth: more layers than DeepStack levels, or the last level could not matter
    # Audio tower (Qwen2-Audio, Omni): (d_model, layers, heads, ffn width); Omni's chunk is 2 x n_window frames.
    audio: tuple[int, int, int, int] = (32, 2, 2, 64)
    audio_n_window: int = 10


SIZES: dict[str, SizeSpec] = {
    # A large init range makes the random model sensitive to its image input, which tests rely on. Qwen3-VL:
    # DeepStack from non-adjacent blocks, and a 4x4 position grid smaller than any picture's, so it is resampled.
    "tiny": SizeSpec(1000, 64, 2, 4, 2, 128, (2, 3, 3), 32, 2, 2, 4, 64, (1, 3), 28 * 28 * 256,
                     torch.float32, 0.15, False, vit_depth_3=4, deepstack_3=(0, 2), position_grid_3=4,
                     experts=(4, 2, 48), layers_3=3, audio=(32, 2, 2, 64), audio_n_window=10),
    "small": SizeSpec(1000, 128, 4, 4, 2, 256, (4, 6, 6), 64, 4, 2, 4, 128, (1, 3), 28 * 28 * 256,
                      torch.float32, 0.15, False, vit_depth_3=4, deepstack_3=(0, 2), position_grid_3=8,
                      experts=(4, 2, 96), layers_3=4, audio=(64, 2, 4, 128), audio_n_window=10),
    # Real proportions (head_dim 128, GQA 4:1) for benchmarks; ~240M parameters (Qwen3-VL-MoE: ~550M, top-2 of 8).
    "medium": SizeSpec(8000, 1024, 12, 8, 2, 4096, (16, 24, 24), 640, 10, 8, 8, 1728, (3, 7), 1003520,
                       torch.bfloat16, 0.02, True, vit_depth_3=8, deepstack_3=(1, 3, 5), position_grid_3=48,
                       experts=(8, 2, 1536), layers_3=12, audio=(512, 6, 8, 2048), audio_n_window=100),
}

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
PATCH_SIZE_3 = 16  # Qwen3-VL
MRoPE_SECTIONS_3 = {"tiny": (2, 3, 3), "small": (4, 6, 6), "medium": (24, 20, 20)}  # Qwen3-VL's own split at 128
# Whisper's log-mel front end, as Qwen2-Audio and Omni ship it: 128 bins of 10 ms at 16 kHz; Qwen2-Audio reads
# 30 s windows, Omni's extractor pads to 300 s (its tower reads valid frames only).
MEL_BINS, SAMPLING_RATE, HOP_LENGTH, N_FFT = 128, 16000, 160, 400
AUDIO_POSITIONS = 1500  # rows of the tower's position table: 30 s after the stride-2 conv


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _check_spec(spec: SizeSpec) -> None:
    head_dim = spec.hidden // spec.heads
    if sum(spec.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    # The vision 2-D rotary embedding splits each head into (h, w) halves of cos/sin pairs.
    if (spec.vit_width // spec.vit_heads) % 4:
        raise ValueError("vision head_dim must be divisible by 4")


def _vision_config(arch: str, spec: SizeSpec, init_range: float) -> dict[str, Any]:
    common = {
        "num_heads": spec.vit_heads,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "initializer_range": init_range,
    }
    if arch in QWEN3_VISION:
        deepstack = {"deepstack_visual_indexes": list(spec.deepstack_3)} if arch in QWEN3 else {}
        return {**common, "patch_size": PATCH_SIZE_3, "hidden_size": spec.vit_width, "out_hidden_size": spec.hidden,
                "intermediate_size": spec.vit_intermediate_25, "depth": spec.vit_depth_3, **deepstack,
                "num_position_embeddings": spec.position_grid_3**2, "hidden_act": "gelu_pytorch_tanh"}
    if arch == "qwen2_vl":
        # In Qwen2-VL `hidden_size` is the merger's output width (= LM hidden), `embed_dim` the ViT width.
        return {**common, "embed_dim": spec.vit_width, "hidden_size": spec.hidden, "depth": spec.vit_depth_2,
                "mlp_ratio": 4, "hidden_act": "quick_gelu"}
    # In Qwen2.5-VL `hidden_size` is the ViT width and `out_hidden_size` the merger's output width.
    return {**common, "hidden_size": spec.vit_width, "out_hidden_size": spec.hidden,
            "intermediate_size": spec.vit_intermediate_25, "depth": spec.vit_depth_25,
            "fullatt_block_indexes": list(spec.fullatt_blocks_25), "window_size": 112,
            "hidden_act": "silu", "tokens_per_second": 2}


def _model_config(arch: str, size: str, vocab_size: int, ids: dict[str, int], init_range: float) -> Any:
    spec = SIZES[size]
    token_ids = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    text = _text_config(spec, vocab_size, token_ids, init_range)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(spec.mrope_section),
                               "rope_theta": 1000000.0}
    if arch in QWEN3:
        text["head_dim"] = spec.hidden // spec.heads
        text["num_hidden_layers"] = spec.layers_3
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(MRoPE_SECTIONS_3[size]),
                                   "mrope_interleaved": True, "rope_theta": 5000000.0}
    if arch in QWEN3_5:
        text = tiny_qwen3_5.text_config(arch, size, text, spec.experts)
    if arch == "qwen3_vl_moe":
        text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"] = spec.experts
        text["decoder_sparse_step"] = 1
    config_cls = ARCHES[arch][0]
    return config_cls(
        text_config=text,
        vision_config=_vision_config(arch, spec, init_range),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_embeddings,
        # Duplicated at the top level because flat (hub-style) readers look for them there.
        **token_ids,
    )


def _text_config(spec: SizeSpec, vocab_size: int, token_ids: dict[str, int], init_range: float) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_range,
        **token_ids,
    }


def _audio_tower_config(spec: SizeSpec, init_range: float) -> dict[str, Any]:
    d_model, layers, heads, ffn = spec.audio
    return {"num_mel_bins": MEL_BINS, "d_model": d_model, "encoder_layers": layers, "encoder_attention_heads": heads,
            "encoder_ffn_dim": ffn, "max_source_positions": AUDIO_POSITIONS, "activation_function": "gelu",
            "initializer_range": init_range}


def _audio_model_config(arch: str, size: str, vocab_size: int, ids: dict[str, int], init_range: float) -> Any:
    """Qwen2-Audio (a Qwen2 LM with 1-D RoPE) or Qwen2.5-Omni's thinker (Qwen2.5-VL's vision tower and M-RoPE
    LM), or the full Omni model around that thinker with a minimal talker and token2wav."""
    spec = SIZES[size]
    token_ids = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                 "pad_token_id": ids["<|endoftext|>"]}
    text = _text_config(spec, vocab_size, token_ids, init_range)
    if arch == "qwen2_audio":
        text |= {"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                 "tie_word_embeddings": False}  # transformers never ties Qwen2-Audio's head
        return ARCHES[arch][0](text_config=text, audio_config={"model_type": "qwen2_audio_encoder",
                                                              **_audio_tower_config(spec, init_range)},
                               audio_token_index=ids["<|AUDIO|>"])
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(spec.mrope_section),
                               "rope_theta": 1000000.0}
    vision = _vision_config("qwen2_5_vl", spec, init_range)
    del vision["tokens_per_second"]  # Omni spaces video by the thinker's position_id_per_seconds
    audio = _audio_tower_config(spec, init_range) | {"n_window": spec.audio_n_window, "output_dim": spec.hidden}
    media_ids = {"image_token_index": ids["<|IMAGE|>"], "video_token_index": ids["<|VIDEO|>"],
                 "audio_token_index": ids["<|AUDIO|>"], "vision_start_token_id": ids["<|vision_bos|>"],
                 "vision_end_token_id": ids["<|vision_eos|>"], "audio_start_token_id": ids["<|audio_bos|>"],
                 "audio_end_token_id": ids["<|audio_eos|>"]}
    thinker = transformers.Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, position_id_per_seconds=25, seconds_per_chunk=2,
        tie_word_embeddings=spec.tie_embeddings, initializer_range=init_range, **media_ids, **token_ids)
    if arch == "qwen2_5_omni":
        return thinker
    # The talker turns the thinker's states into codec tokens, token2wav those into sound: random and minimal,
    # present so the checkpoint has what a released one has (vlserve skips their weights).
    talker = {"hidden_size": 32, "embedding_size": spec.hidden, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "initializer_range": init_range,
              "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
              **media_ids, **{k: v for k, v in token_ids.items() if k != "eos_token_id"}}
    dit = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16, "emb_dim": 16,
           "enc_emb_dim": 16, "enc_dim": 16, "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8,
           "enc_se_channels": 8, "num_embeds": 32, "mel_dim": 8, "look_ahead_layers": [0],
           "look_backward_layers": [0]}
    bigvgan = {"mel_dim": 8, "upsample_initial_channel": 16, "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
               "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]}
    return ARCHES[arch][0](thinker_config=thinker.to_dict(), talker_config=talker,
                           token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan})


def _audio_preprocessor_config(arch: str, max_pixels: int) -> dict[str, Any]:
    """WhisperFeatureExtractor's fields (Omni: with its picture processor's in the same file)."""
    seconds = 300 if arch in OMNI else 30
    audio = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": MEL_BINS,
        "sampling_rate": SAMPLING_RATE,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "chunk_length": seconds,
        "n_samples": seconds * SAMPLING_RATE,
        "nb_max_frames": seconds * SAMPLING_RATE // HOP_LENGTH,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
        "processor_class": "Qwen2_5OmniProcessor" if arch in OMNI else "Qwen2AudioProcessor",
    }
    return _preprocessor_config(arch, max_pixels) | audio if arch in OMNI else audio


def _preprocessor_config(arch: str, max_pixels: int) -> dict[str, Any]:
    qwen3 = arch in QWEN3_VISION
    patch = PATCH_SIZE_3 if qwen3 else PATCH_SIZE
    min_pixels = (patch * MERGE_SIZE * 2) ** 2 if qwen3 else MIN_PIXELS
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5] * 3 if qwen3 else CLIP_MEAN,
        "image_std": [0.5] * 3 if qwen3 else CLIP_STD,
        "resample": 3,  # PIL bicubic
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def _video_preprocessor_config(spec: SizeSpec) -> dict[str, Any]:
    """Qwen3-VL reads video settings from their own file: sampling rate, frame bounds, total pixel budget."""
    factor = PATCH_SIZE_3 * MERGE_SIZE
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": (2 * factor) ** 2, "longest_edge": 16 * spec.max_pixels},
        "patch_size": PATCH_SIZE_3,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 64,
        "do_sample_frames": True,
    }


def _check_saved(out_dir: Path, arch: str, init_range: float) -> None:
    """Re-read what landed on disk: right architecture, and weights with the std we asked for."""
    config = json.loads((out_dir / "config.json").read_text())
    expected = [ARCHES[arch][1].__name__]
    if config.get("architectures") != expected:
        raise RuntimeError(f"config.json architectures {config.get('architectures')} != {expected}")
    # One text and one matrix of each tower: proves initializer_range reached every sub-config.
    probes = ("model.layers.0.self_attn.q_proj.weight",)
    probes += ("audio_tower.layers.0.self_attn.q_proj.weight",) if arch in AUDIO else ()
    probes += ("visual.blocks.0.attn.q.weight",) if arch in OMNI else ()
    probes += ("visual.blocks.0.attn.qkv.weight",) if arch not in AUDIO else ()
    builder = family_builder(arch)
    probes = builder.PROBES if builder else tiny_qwen3_5.PROBES if arch in QWEN3_5 else probes
    found: dict[str, float] = {}
    for shard in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                for name in probes:
                    if key.endswith(name):
                        found[name] = f.get_tensor(key).float().std().item()
    for name in probes:
        std = found.get(name)
        if std is None:
            raise RuntimeError(f"{name} missing from the saved checkpoint")
        if not 0.8 * init_range < std < 1.2 * init_range:
            raise RuntimeError(f"{name} has std {std:.4f}, expected about {init_range}")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2_vl",
    size: str = "tiny",
    seed: int = 0,
    initializer_range: float | None = None,
) -> Path:
    """Write a random, loadable HF checkpoint (weights, config, tokenizer, processor) to `out_dir`."""
    if arch not in ARCHES:
        raise InvalidInputError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
    if size not in SIZES:
        raise InvalidInputError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if initializer_range is not None and not (
        isinstance(initializer_range, (int, float)) and math.isfinite(initializer_range) and initializer_range > 0
    ):
        raise InvalidInputError(f"initializer_range must be a positive number, got {initializer_range!r}")
    spec = SIZES[size]
    _check_spec(spec)
    init_range = spec.init_range if initializer_range is None else float(initializer_range)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    with tqdm(total=4, desc=f"make-tiny-model {arch}/{size}", unit="step", leave=False) as bar:
        bar.set_postfix_str("tokenizer")
        builder = family_builder(arch)
        special, template, names = TOKENIZERS.get(arch, (SPECIAL_TOKENS, CHAT_TEMPLATE, None))
        eos_pad = {}
        if builder:
            special, template, names, eos, pad = builder.tokenizer_spec(arch)
            eos_pad = {"eos_token": eos, "pad_token": pad}
        tokenizer = build_tokenizer(spec.bpe_vocab, special_tokens=special, chat_template=template, token_names=names,
                                    **eos_pad)
        ids = special_token_ids(tokenizer, special)
        vocab_size = _round_up(len(tokenizer), 64)  # GPU-friendly embedding rows, like Qwen's padding
        save_tokenizer(tokenizer, out)
        bar.update()

        bar.set_postfix_str("weights")
        if builder:
            config = builder.model_config(arch, spec, vocab_size, ids, init_range, ARCHES[arch][0])
        else:
            config = (_audio_model_config if arch in AUDIO else _model_config)(arch, size, vocab_size, ids,
                                                                                 init_range)
        with torch.random.fork_rng(devices=[]):  # seed our init without disturbing the caller's RNG
            torch.manual_seed(seed)
            model: PreTrainedModel = ARCHES[arch][1](config).eval()
            if builder and hasattr(builder, "randomize"):
                builder.randomize(model, init_range)
        if spec.dtype != torch.float32:
            model.to(spec.dtype)  # save_pretrained records the model's dtype in config.json
        n_params = sum(p.numel() for p in model.parameters())
        bar.update()

        bar.set_postfix_str("save")
        model.save_pretrained(str(out), safe_serialization=True)
        # Qwen2-VL stops on <|im_end|> in chat and on <|endoftext|> for raw text.
        generation = builder.generation_ids(arch, ids) if builder else {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        }
        GenerationConfig(**generation).save_pretrained(str(out))
        if builder:
            files = builder.processor_files(arch)
        else:
            files = {"preprocessor_config.json": (_audio_preprocessor_config if arch in AUDIO
                                                  else _preprocessor_config)(arch, spec.max_pixels)}
        for name, contents in files.items():
            (out / name).write_text(json.dumps(contents, indent=2))
        if arch == "qwen2_5_omni_full":  # transformers' full Omni loads its talker's voices from here
            torch.save({}, out / "spk_dict.pt")
        if arch in QWEN3_VISION:
            (out / "video_preprocessor_config.json").write_text(json.dumps(_video_preprocessor_config(spec), indent=2))
        bar.update()

        bar.set_postfix_str("verify")
        _check_saved(out, arch, init_range)
        bar.update()

    tqdm.write(f"make-tiny-model: {arch}/{size} {n_params / 1e6:.2f}M params, "
               f"{time.perf_counter() - start:.1f}s -> {out}", file=sys.stderr)
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Number of stored weight elements (a tied lm_head is not stored, so it is not counted)."""
    total = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total
