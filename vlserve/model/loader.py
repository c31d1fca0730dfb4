"""Find a checkpoint (local folder or hub id) and load its safetensors weights into our model classes.

Checkpoint names are mapped onto ours by the model's family (its `weight_names`: prefix renames, then the fused
parameters of vlserve.model.weight_names, whose pieces land in their rows here); a Conv3d patch embedding goes
into a Linear. MoE experts come in two layouts (see `expert_tensor`).
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from vlserve.core.errors import ModelLoadError
from vlserve.model.families import family_of
from vlserve.model.hardware import resolve_dtype
from vlserve.model.kernels import cpu_kernels
from vlserve.model.hf_config import ModelConfig, load_model_config
from vlserve.model.layers.parallel import SINGLE, TPGroup, building_for, rule_for
from vlserve.model.quantization import (
    INT4_SUFFIXES,
    QuantizationConfig,
    checkpoint_tensor,
    prepare_int4,
    quantize_int8,
    quantized_buffers,
    resolve_quantization,
)
from vlserve.model.weight_names import EXPERT_SHARD, FUSED_SHARDS

logger = logging.getLogger(__name__)

PROGRESS_BAR_MIN_BYTES = 256 * 2**20
# tqdm's default lock is a multiprocessing semaphore, which processes stopped by a signal leave behind (and the
# resource tracker then warns about); a thread lock is all one process needs.
tqdm.set_lock(threading.RLock())




def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json found")
    return files


EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")


def expert_tensor(tensor: torch.Tensor, target_shape: torch.Size, transformers_major: int | None) -> torch.Tensor:
    """An MoE expert weight in our linear layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`).

    transformers 5 saves that layout; released Qwen3-VL-MoE checkpoints (transformers 4.57) store the transpose,
    `[E, H, 2I]` / `[E, I, H]`. The shape tells which, except when the two are equal (H == 2I, or H == I): then
    the transformers version that saved the checkpoint decides.
    """
    if tensor.dim() != 3:
        return tensor
    transposed = tensor.transpose(1, 2)
    if tensor.shape == target_shape and transposed.shape == target_shape:
        return transposed if transformers_major is not None and transformers_major < 5 else tensor
    return transposed if transposed.shape == target_shape else tensor


def _shard_view(model: nn.Module, name: str, param: torch.Tensor, shard: str) -> torch.Tensor:
    """The rows of fused parameter `name` that checkpoint piece `shard` fills.

    Offsets and sizes come from the model (never from the incoming tensor), so a piece of the wrong size
    fails the shape check instead of landing silently in its neighbour's rows.
    """
    expert = EXPERT_SHARD.match(shard)
    if expert:  # one expert's matrix of the 3-D expert weights
        e, kind = int(expert[1]), expert[2]
        if e >= param.shape[0]:
            raise ModelLoadError(f"'{name}': expert {e} of a model with {param.shape[0]} experts")
        return param[e] if kind == "down" else _shard_view(model, name, param[e], kind)
    return param.narrow(0, *shard_rows(model, name, param.shape[0], shard))


def shard_rows(model: nn.Module, name: str, total: int, shard: str) -> tuple[int, int]:
    """(first row, rows) of fused parameter `name` (`total` rows) that piece `shard` (q/k/v, gate/up) fills."""
    if shard in ("gate", "up"):
        half = total // 2
        return (0 if shard == "gate" else half), half
    attn = model.get_submodule(name.rsplit(".", 2)[0])  # "...self_attn.qkv_proj.weight" -> the attention module
    q, kv = attn.q_size, attn.kv_size
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_weights(model: nn.Module, folder: Path, files: list[Path] | None = None,
                 quantization: QuantizationConfig | None = None, our_name=None) -> None:
    """`our_name`: the family's checkpoint-name mapping (the model's own family when None)."""
    files = files or weight_files(folder)
    if our_name is None:
        family = family_of(model.cfg.architecture)
        our_name = family.load(family.weight_names)
    int4_buffers = quantized_buffers(model)
    params = dict(model.named_parameters()) | int4_buffers
    # Parts this model was built with: a role that leaves one out (an encoder has no LM) skips its tensors
    # silently, and so does a tied LM head stored anyway. Unknown tensors of a built part are worth a warning.
    built = {name.split(".", 1)[0] for name in params}
    int4_linears = {name.rsplit(".", 1)[0] for name in int4_buffers}
    cfg = getattr(model, "cfg", None)
    transformers_major = cfg.transformers_major if cfg is not None else None
    loaded: set[str] = set()
    unexpected: list[str] = []
    total_bytes = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights",
               disable=total_bytes < PROGRESS_BAR_MIN_BYTES)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    named = our_name(key)
                    if named is None:
                        continue
                    name, shard = named
                    quantized = name.endswith(INT4_SUFFIXES) and name.rsplit(".", 1)[0] in int4_linears
                    if quantized:
                        converted = checkpoint_tensor(name, f.get_tensor(key), quantization)
                        if converted is None:
                            continue
                        name, tensor = converted
                    if name not in params:
                        if name.split(".", 1)[0] in built:
                            unexpected.append(key)
                        continue
                    if not quantized:
                        tensor = f.get_tensor(key)
                    param = params[name].data
                    rule = rule_for(model, name)  # tensor parallel: this rank's part
                    if name.endswith("patch_embed.proj.weight"):
                        tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d kernel -> Linear
                    elif name.endswith(EXPERT_TENSORS):
                        full = rule.full_shape(param.shape) if rule is not None else param.shape
                        tensor = expert_tensor(tensor, full, transformers_major)
                    expert = EXPERT_SHARD.match(shard) if shard else None
                    if expert and rule is not None:  # one expert: cut as a slice of the 3-D weight would be
                        kind = expert[2]
                        tensor = rule.local(tensor.unsqueeze(0), None if kind == "down" else kind).squeeze(0)
                    elif rule is not None:
                        tensor = rule.local(tensor, shard)
                    target = _shard_view(model, name, param, shard) if shard else param
                    if target.shape != tensor.shape:
                        raise ModelLoadError(
                            f"{file.name}: '{key}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    loaded.add(f"{name}:{shard}")
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file ({e})") from e
        bar.update(file.stat().st_size)
    bar.close()
    missing = []
    for name in params:  # a fused parameter is whole when stored whole or when every piece of it was
        pieces = next((s for key, s in FUSED_SHARDS.items() if f".{key}." in name), ())
        if name.endswith(EXPERT_TENSORS) and f"{name}:None" not in loaded:  # stored one expert at a time
            kinds = ("down",) if name.endswith("down_proj") else ("gate", "up")
            pieces = tuple(f"e{e}.{k}" for e in range(params[name].shape[0]) for k in kinds)
        if f"{name}:None" in loaded or pieces and all(f"{name}:{s}" in loaded for s in pieces):
            continue
        missing += [f"{name}:{s}" for s in pieces if f"{name}:{s}" not in loaded] or [name]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensors with no matching parameter, e.g. %s", len(unexpected),
                       unexpected[:3])


def load_model(
    folder: Path,
    cfg: ModelConfig | None = None,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    with_vision: bool = True,
    with_language: bool = True,
    quantization: QuantizationConfig | None = None,
    tp: TPGroup = SINGLE,
    vision_tp: TPGroup | None = None,
    towers: tuple[str, ...] | None = None,
) -> nn.Module:
    """Build the model for `cfg.architecture` without random init (meta device) and fill it from safetensors;
    `quantization` (see vlserve.model.quantization) swaps in quantized linears before or after loading.
    `tp`: this rank's share of a tensor-parallel model (`vision_tp`: the vision tower's, when it differs).
    `towers`: the media towers to build ("vision", "audio"; None: all the model has); others' tensors are skipped."""
    cfg = cfg or load_model_config(folder)
    if quantization is None and cfg.quantization:  # a 4-bit checkpoint loads as one whatever the caller passed
        quantization = resolve_quantization(None, cfg.quantization)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg.checkpoint_dtype, device)
    family = family_of(cfg.architecture)
    our_name = family.load(family.weight_names)
    files = weight_files(folder)
    with torch.device("meta"), _default_dtype(torch_dtype), building_for(tp):
        build = family.load(family.model)
        model = build(cfg, with_vision=with_vision, with_language=with_language, vision_tp=vision_tp, towers=towers)
        if quantization is not None and quantization.is_checkpoint_format:
            logger.info("%s checkpoint: %d linears run in int4", quantization.method,
                        prepare_int4(model, files, quantization, our_name))
    # Plain empties, not `to_empty`: its `empty_like` on meta tensors imports sympy (~0.4 s of every start).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    load_weights(model, folder, files, quantization, our_name)
    if quantization is not None and quantization.method == "int8":
        logger.info("int8: %d decoder linears quantized at load time", quantize_int8(model))
    if device.type == "cpu":
        cpu_kernels.load()  # now, not inside the first request (and the log says at start if they are missing)
    return model.eval().requires_grad_(False)
