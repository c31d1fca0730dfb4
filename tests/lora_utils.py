"""LoRA adapters in PEFT's on-disk format for the tiny checkpoints, and the merged checkpoints that are their
reference (what PEFT's `merge_and_unload` saves): pure torch + safetensors, peft is not installed.

An adapter names its modules by the checkpoint's own tensor names (`base_model.model.<tensor name minus
.weight>.lora_A.weight`); its A and B are random, like a trained adapter's (PEFT starts B at zero, which would
make every adapter a no-op), and large enough to change the tiny models' greedy tokens."""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vlserve.tools.tiny_adapter import (  # noqa: F401 - re-exported for the tests
    EXPERT_NESTING,
    PEFT_PREFIX,
    TARGETS,
    checkpoint_shapes,
    expert_weights,
    lora_scale,
    make_peft_adapter,
    short_name,
    target_weights,
)

def read_adapter(adapter: Path, ckpt: Path | None = None) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(scale, checkpoint weight name -> (A, B)) of a PEFT adapter folder this module wrote; an expert weight's
    pair (`<experts>.gate_up_proj`, needs `ckpt`) as A [E, r, in], B [E, out, r]."""
    adapter = Path(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ValueError("per-module ranks / alphas and DoRA are not handled here")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    nested = {suffix: weight for weight, suffix in EXPERT_NESTING.items()}
    n_experts = {n: shape[0] for n, shape in expert_weights(ckpt).items()} if config.get("target_parameters") else {}
    pairs = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        b = tensors[module + ".lora_B.weight"]
        name = module.removeprefix(PEFT_PREFIX)
        weight = next((w for suffix, w in nested.items() if name.endswith(".experts" + suffix)), None)
        if weight is None:
            pairs[name + ".weight"] = (a, b)
            continue
        name = name.removesuffix(EXPERT_NESTING[weight]) + "." + weight
        e = n_experts[name]
        pairs[name] = (a.reshape(e, -1, a.shape[-1]), b.reshape(b.shape[0], -1, e).permute(2, 0, 1))
    return lora_scale(config), pairs


def merge_adapter(ckpt: Path, adapter: Path, out: Path) -> Path:
    """A copy of `ckpt` (config, tokenizer, processor files) whose weights are W + scale * B @ A (float32 math)
    for every module of `adapter`, each expert's matrix of an expert weight W_e + scale * B_e @ A_e (in either
    storage, expert_weights): the merged model transformers' reference runs."""
    out = Path(out)
    shutil.copytree(ckpt, out)
    scale, pairs = read_adapter(adapter, ckpt)
    stored = checkpoint_shapes(ckpt)
    deltas = {}
    for name, (a, b) in pairs.items():
        delta = scale * (b.float() @ a.float())
        if name in stored:
            deltas[name] = delta
            continue
        experts, _, weight = name.rpartition(".")  # stored one expert at a time
        for e in range(delta.shape[0]):
            if weight == "down_proj":
                deltas[f"{experts}.{e}.down_proj.weight"] = delta[e]
            else:
                gate, up = delta[e].chunk(2)
                deltas.update({f"{experts}.{e}.gate_proj.weight": gate, f"{experts}.{e}.up_proj.weight": up})
    left = set(deltas)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in left & set(tensors):
            w = tensors[name]
            tensors[name] = (w.float() + deltas[name]).to(w.dtype)
        left -= set(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})
    if left:
        raise KeyError(f"adapter modules not in the checkpoint: {sorted(left)[:5]}")
    return out


def _digest(t: torch.Tensor) -> tuple:
    return tuple(t.shape), hashlib.sha1(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def modules_by_weight(model: torch.nn.Module, ckpt: Path) -> dict[str, torch.nn.Linear]:
    """checkpoint weight name -> the nn.Linear transformers loaded it into, found by the weight's values (random
    weights are unique), so no renaming rule of transformers' (`model.language_model.` ...) is assumed."""
    linears = {_digest(m.weight): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    found = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if t.ndim == 2 and _digest(t) in linears:
                found[name] = linears[_digest(t)]
    return found


@contextmanager
def unmerged_lora(model: torch.nn.Module, ckpt: Path, adapter: Path):
    """PEFT's unmerged forward on a transformers model of `ckpt`: every adapted nn.Linear's output gets
    scale * x @ A.T @ B.T added (a forward hook), for as long as the context lasts."""
    scale, pairs = read_adapter(adapter)
    modules = modules_by_weight(model, ckpt)
    missing = set(pairs) - set(modules)
    if missing:
        raise KeyError(f"adapter modules transformers has no nn.Linear for: {sorted(missing)[:5]}")

    def hook(a, b):
        return lambda mod, args, out: out + scale * (args[0] @ a.T) @ b.T

    handles = [modules[name].register_forward_hook(hook(a, b)) for name, (a, b) in pairs.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def make_adapters(ckpt, root, made: dict[str, tuple[str, int]]) -> dict:
    """Adapters of `ckpt` under `root`: name -> (what they target: "lm", "tower" or "both"; seed) -> their folders."""
    return {name: make_peft_adapter(ckpt, root / name, targets, seed=seed) for name, (targets, seed) in made.items()}
