"""Create small random checkpoints of the families listed in tiny_arches.py in the Hugging Face layout, fully
offline.

Each family builds what is its own through its builder module (`TinyArch.builder`), which gives:
`tokenizer_spec(arch)` -> (special tokens, chat template, tokenizer attributes naming them, eos token, pad token);
`model_config(arch, size_spec, vocab_size, special token ids, init_range, transformers config class)`;
`generation_ids(arch, ids)` (generation_config.json's bos / eos / pad); `processor_files(arch, size_spec)` (file
name -> JSON contents); `PROBES` (weights whose std `initializer_range` must have set). Optional:
`probes(arch)` where a family's arches probe different weights (else `PROBES`); `randomize(model, init_range)`
to redraw weights transformers initialises otherwise; `write_extra_files(arch, out_dir)` for files that are not
JSON (e.g. a model's voices). A `SizeSpec` holds what every family reads of a size; a family keeps its own
per-size details under the size's `name`.

The weights come from transformers' own model classes, so the folder is exactly what
`from_pretrained` expects; the tokenizer is a freshly trained byte-level BPE (see bpe_tokenizer.py) with the
family's special tokens and chat template.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedModel

from vlserve.core.errors import InvalidInputError
from vlserve.tools.bpe_tokenizer import build_tokenizer, save_tokenizer, special_token_ids
from vlserve.tools.tiny_arches import DEFAULT_ARCH, TINY_ARCHES

# arch -> (transformers config class, model class); the families themselves are listed in tiny_arches.py
ARCHES: dict[str, tuple[type, type]] = {
    name: (getattr(transformers, a.config_class), getattr(transformers, a.model_class))
    for name, a in TINY_ARCHES.items()
}


def family_builder(arch: str):
    """The family's own builder module (see the module docstring)."""
    return importlib.import_module(TINY_ARCHES[arch].builder)


@dataclass(frozen=True)
class SizeSpec:
    """Shape of one model size, as every family reads it. `vit_*` describe the vision tower; `hidden` etc. the
    language model."""

    name: str  # "tiny", "small", "medium": a family's own per-size details are kept under it
    bpe_vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vit_width: int
    vit_heads: int
    vit_depth: int
    dtype: torch.dtype
    init_range: float  # default initializer_range
    tie_embeddings: bool


SIZES: dict[str, SizeSpec] = {spec.name: spec for spec in (
    # A large init range makes the random model sensitive to its image input, which tests rely on.
    SizeSpec("tiny", 1000, 64, 2, 4, 2, 128, 32, 2, 4, torch.float32, 0.15, False),
    SizeSpec("small", 1000, 128, 4, 4, 2, 256, 64, 4, 4, torch.float32, 0.15, False),
    # Real proportions (head_dim 128, GQA 4:1) for benchmarks; ~240M parameters.
    SizeSpec("medium", 8000, 1024, 12, 8, 2, 4096, 640, 10, 8, torch.bfloat16, 0.02, True),
)}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _check_saved(out_dir: Path, arch: str, init_range: float, probes: tuple[str, ...]) -> None:
    """Re-read what landed on disk: right architecture, and weights with the std we asked for."""
    config = json.loads((out_dir / "config.json").read_text())
    expected = [ARCHES[arch][1].__name__]
    if config.get("architectures") != expected:
        raise RuntimeError(f"config.json architectures {config.get('architectures')} != {expected}")
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
    arch: str = DEFAULT_ARCH,
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
    init_range = spec.init_range if initializer_range is None else float(initializer_range)
    builder = family_builder(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    with tqdm(total=4, desc=f"make-tiny-model {arch}/{size}", unit="step", leave=False) as bar:
        bar.set_postfix_str("tokenizer")
        special, template, names, eos, pad = builder.tokenizer_spec(arch)
        tokenizer = build_tokenizer(spec.bpe_vocab, special_tokens=special, chat_template=template, token_names=names,
                                    eos_token=eos, pad_token=pad)
        ids = special_token_ids(tokenizer, special)
        vocab_size = _round_up(len(tokenizer), 64)  # GPU-friendly embedding rows, as released checkpoints pad
        save_tokenizer(tokenizer, out)
        bar.update()

        bar.set_postfix_str("weights")
        config = builder.model_config(arch, spec, vocab_size, ids, init_range, ARCHES[arch][0])
        with torch.random.fork_rng(devices=[]):  # seed our init without disturbing the caller's RNG
            torch.manual_seed(seed)
            model: PreTrainedModel = ARCHES[arch][1](config).eval()
            if hasattr(builder, "randomize"):
                builder.randomize(model, init_range)
        if spec.dtype != torch.float32:
            model.to(spec.dtype)  # save_pretrained records the model's dtype in config.json
        n_params = sum(p.numel() for p in model.parameters())
        bar.update()

        bar.set_postfix_str("save")
        model.save_pretrained(str(out), safe_serialization=True)
        GenerationConfig(**builder.generation_ids(arch, ids)).save_pretrained(str(out))
        for name, contents in builder.processor_files(arch, spec).items():
            (out / name).write_text(json.dumps(contents, indent=2))
        if hasattr(builder, "write_extra_files"):
            builder.write_extra_files(arch, out)
        bar.update()

        bar.set_postfix_str("verify")
        _check_saved(out, arch, init_range, builder.probes(arch) if hasattr(builder, "probes") else builder.PROBES)
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
