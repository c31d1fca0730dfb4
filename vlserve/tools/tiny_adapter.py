"""LoRA adapters in PEFT's on-disk format for a checkpoint (`vlserve make-tiny-adapter`, and the test suite's):
pure torch + safetensors, peft is not needed.

An adapter names its modules by the checkpoint's own tensor names (`base_model.model.<tensor name minus
.weight>.lora_A.weight`); its A and B are random, like a trained adapter's, so that it changes answers: PEFT
starts B at zero, which makes a fresh adapter a no-op (the trap of trying LoRA with one)."""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlserve.model.weight_names import EXPERT_PIECE

PEFT_PREFIX = "base_model.model."
# where PEFT saves the pair of each MoE expert weight of a module (`target_parameters`): one wrapper per weight,
# nested in the order the module holds them (the first innermost)
EXPERT_NESTING = {"gate_up_proj": ".base_layer", "down_proj": ""}
TARGETS = ("lm", "tower", "both")
# media towers and their projectors, in each layout the tiny checkpoints use (Qwen2/2.5-VL `visual.`, Qwen3-VL
# `model.visual.`, LLaVA `vision_tower.` + projector, Qwen2-Audio `audio_tower.` + `multi_modal_projector.linear`)
TOWER_PREFIXES = tuple(p + t for p in ("", "model.")
                       for t in ("visual.", "vision_tower.", "audio_tower.", "multi_modal_projector."))
# the language model's decoder linears: attention q/k/v/o, dense MLP gate/up/down (MoE experts are not nn.Linear)
LM_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def checkpoint_shapes(ckpt: Path) -> dict[str, list[int]]:
    """tensor name -> shape over every safetensors file of the checkpoint, without loading a tensor."""
    shapes = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            names = sf.keys()  # a safetensors file, not a dict
            shapes.update({k: sf.get_slice(k).get_shape() for k in names})
    return shapes


def _is_tower_linear(name: str, shape: list[int]) -> bool:
    """A 2-D weight of a tower or projector that is not an embedding (patch embeddings are convolutions, but
    position tables are 2-D too: `pos_embed`, `position_embedding`, `embed_positions`, and so is Qwen2.5-Omni's
    `audio_bos_eos_token`)."""
    return (name.startswith(TOWER_PREFIXES) and name.endswith(".weight") and len(shape) == 2
            and "embed" not in name and "bos_eos_token" not in name)  # (Qwen2.5-Omni's audio markers: an embedding)


def target_weights(ckpt: Path, targets: str = "lm") -> dict[str, list[int]]:
    """The checkpoint's linear weights an adapter of `targets` ("lm", "tower", "both") adapts: name -> [out, in]."""
    if targets not in TARGETS:
        raise ValueError(f"targets is one of {TARGETS}, not {targets!r}")
    picked = {}
    for name, shape in checkpoint_shapes(ckpt).items():
        lm = not name.startswith(TOWER_PREFIXES) and bool(LM_LINEAR.search(name)) and len(shape) == 2
        if (targets in ("lm", "both") and lm) or (targets in ("tower", "both") and _is_tower_linear(name, shape)):
            picked[name] = shape
    if not picked:
        raise ValueError(f"{ckpt}: no {targets} linear weights")
    return dict(sorted(picked.items()))


def short_name(module: str) -> str:
    """PEFT's `target_modules` entry for a module: its last name, with its parent where that is an index (the
    Qwen merger's `mlp.0`), since PEFT matches entries as dotted suffixes."""
    parts = module.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def lora_scale(config: dict) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def expert_weights(ckpt: Path) -> dict[str, tuple[int, int, int]]:
    """The checkpoint's 3-D MoE expert weights as transformers 5 holds them, `<experts>.gate_up_proj` and
    `<experts>.down_proj` -> (E, out, in), whether the checkpoint stores them so or one expert at a time
    (`<experts>.<e>.gate_proj.weight` ..., Qwen3.5-MoE)."""
    found: dict[str, tuple[int, int, int]] = {}
    per_expert: dict[str, dict[int, dict[str, list[int]]]] = {}
    for name, shape in checkpoint_shapes(ckpt).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3:
            found[name] = tuple(shape)
        elif m := EXPERT_PIECE.search(name):
            per_expert.setdefault(name[: m.start()] + ".experts", {}).setdefault(int(m[1]), {})[m[2]] = shape
    for module, experts in per_expert.items():
        (gate_out, n_in), (n_hidden, n_inter) = experts[0]["gate"], experts[0]["down"]
        found[f"{module}.gate_up_proj"] = (len(experts), 2 * gate_out, n_in)
        found[f"{module}.down_proj"] = (len(experts), n_hidden, n_inter)
    return dict(sorted(found.items()))


def make_peft_adapter(ckpt: Path, out: Path, targets: str = "lm", rank: int = 8, alpha: float = 16, seed: int = 0,
                      std: float = 0.1, rslora: bool = False, experts: bool = False) -> Path:
    """A PEFT LoRA adapter folder for `ckpt`: adapter_config.json and adapter_model.safetensors, A [r, in] and
    B [out, r] drawn N(0, std). The tiny weights are N(0, 0.15): with the default alpha / r = 2 the delta moves
    each linear's output by about a third of its size, enough to change the greedy tokens, not enough to make them
    all one token. Each module draws from its own seed, so "both" is the union of "lm" and "tower" of one seed.

    `experts`: also the MoE expert weights, as PEFT's `target_parameters` saves them (checked once against peft
    0.21 on these tiny checkpoints): per weight A [E*r, in] (expert-major rows) and B [out, r*E] (expert-minor
    columns), one wrapper per weight of a module nested in the order the module holds them, so `gate_up_proj`'s
    pair is under `experts.base_layer.lora_*` and `down_proj`'s under `experts.lora_*`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = target_weights(ckpt, targets)
    tensors = {}
    for name, (n_out, n_in) in weights.items():
        module = PEFT_PREFIX + name.removesuffix(".weight")
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
        tensors[f"{module}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    parameters = set()
    for name, (n_experts, n_out, n_in) in (expert_weights(ckpt) if experts else {}).items():
        module, _, weight = name.rpartition(".")
        wrapper = PEFT_PREFIX + module + EXPERT_NESTING[weight]
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        tensors[f"{wrapper}.lora_A.weight"] = torch.randn(n_experts * rank, n_in, generator=gen) * std
        tensors[f"{wrapper}.lora_B.weight"] = torch.randn(n_out, rank * n_experts, generator=gen) * std
        parameters.add(f"mlp.experts.{weight}")
    if experts and not parameters:
        raise ValueError(f"{ckpt}: no MoE expert weights")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({short_name(n.removesuffix(".weight")) for n in weights})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules,
              "target_parameters": sorted(parameters) or None,
              "use_rslora": rslora, "use_dora": False, "bias": "none", "modules_to_save": None,
              "fan_in_fan_out": False, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
              "base_model_name_or_path": str(ckpt), "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def std_for(ckpt: Path, targets: str = "lm", strength: float = 0.4, rank: int = 8, alpha: float = 16) -> float:
    """The spread of A's and B's entries that moves each adapted weight by `strength` times the spread of the
    checkpoint's own weights (measured on its first adapted weight): scale * std^2 * sqrt(rank) = strength * w.
    0.4 gives the tiny checkpoints' 0.1 (their weights are N(0, 0.15)), and a real model's weights (~0.02) an
    adapter that changes its answers without drowning them."""
    name = next(iter(target_weights(ckpt, targets)))
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            if name in sf.keys():
                spread = float(sf.get_tensor(name).float().std())
                break
    scale = alpha / rank
    return math.sqrt(strength * spread / (scale * math.sqrt(rank)))
