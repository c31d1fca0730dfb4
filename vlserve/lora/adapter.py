"""LoRA adapters in PEFT's format, read and checked against the model they adapt.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<checkpoint module>.lora_A.weight` ([rank, in]) and `...lora_B.weight` ([out, rank]). The
checkpoint module goes through the family's own checkpoint-name mapping (the one the loader uses), so an adapter
trained on either transformers layout lands on our modules, a q/k/v or gate/up piece on its rows of our fused
linear.

MoE experts' 3-D weights (`experts.gate_up_proj [E, out, in]`, `experts.down_proj`) take PEFT's
`target_parameters` adapters: one pair per weight, A [E*r, in] (expert e's rows e*r .. e*r+r-1) and B [out, r*E]
(expert e's columns e, e+E, ...), so expert e's delta is B_e A_e. PEFT nests one wrapper per weight of a module,
saving the pairs under `experts.lora_A` and `experts.base_layer.lora_A`; which weight a pair adapts is read from
its shapes (the two weights' (in, out) always differ).

Everything is checked from the file's header before any tensor is used: what cannot be served exactly (DoRA,
trained biases, extra saved modules, embeddings, convolutions, a rank over the limit, shapes that do not fit) is
refused naming the field or tensor, so nothing is ever half-loaded. The files are read once (vlserve.lora.files):
the tensors served are those of the bytes hashed. Weights past `MAX_WEIGHT` (after scaling) are refused too: no
trained adapter comes near it, and such deltas overflow half precision.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vlserve.core.errors import InvalidInputError
from vlserve.lora.files import WEIGHTS_FILE, AdapterFiles, read_files
from vlserve.model.layers.parallel import Column, Row, rule_for
from vlserve.model.weight_names import FUSED_SHARDS

# the largest |A| and |B x scale| served (a delta entry is a sum of rank products of the two)
MAX_WEIGHT = 1e4
# `<module>.lora_A.weight`, PEFT's saved name, or `<module>.lora_A.<adapter>.weight` as a model in memory names it
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<sub>[\w-]+))?\.weight$")
MAX_PATTERNS = 1024  # alpha_pattern entries, each a module name (or the end of one) of at most 256 characters
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
TOWER_PREFIX = {"vision": "visual.", "audio": "audio_tower."}  # each tower's modules (projector included)
TOWER_PREFIXES = tuple(TOWER_PREFIX.values())
LM_PREFIX = "language_model."
TARGET_PREFIXES = (LM_PREFIX + "layers.",) + TOWER_PREFIXES
PEFT_WRAPPERS = re.compile(r"(\.base_layer)+$")  # PEFT's nesting of one wrapper per adapted weight of a module
NOT_TARGETS = ("patch_embed.proj",)  # a convolution stored as a linear: PEFT's conv LoRA has another shape


@dataclass(frozen=True)
class LinearTarget:
    """A linear an adapter may adapt: its whole shape (before tensor parallelism splits it), and the rows each
    checkpoint piece fills (None: all). With `experts` > 0, a 3-D MoE expert weight: that many linears of this
    shape, each with its own delta. `cut`: the weight's tensor-parallel rule (vlserve.model.layers.parallel), which
    cuts this rank's part of an adapter's pairs as it cut the weight."""

    in_features: int
    out_features: int
    pieces: dict[str | None, tuple[int, int]]
    experts: int = 0
    cut: Any = None

    def rows(self, shard: str | None) -> tuple[int, int]:
        return self.pieces[shard]


def lora_targets(model: nn.Module) -> dict[str, LinearTarget]:
    """Every linear of the decoder layers and the media towers (projectors included), by module name, and every
    3-D MoE expert weight of the decoder layers (`<experts module>.<weight>`). The LM head and embeddings are not
    linears here, so never targets."""
    from vlserve.model.loader import shard_rows  # not at import: a front end checks adapters without the loader

    targets = {}
    for name, module in model.named_modules():
        if not name.startswith(TARGET_PREFIXES) or name.endswith(NOT_TARGETS):
            continue
        expert_shapes = getattr(module, "lora_shapes", None)  # vlserve.model.layers.moe.Experts
        if expert_shapes is not None:
            for weight, (n_in, n_out) in expert_shapes.items():
                cut = rule_for(model, f"{name}.{weight}")
                _, n_out, n_in = _whole(cut, (module.num_experts, n_out, n_in))
                targets[f"{name}.{weight}"] = LinearTarget(n_in, n_out, {None: (0, n_out)}, module.num_experts, cut)
            continue
        n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if not isinstance(n_in, int) or not isinstance(n_out, int) or hasattr(module, "num_embeddings"):
            continue
        cut = rule_for(model, f"{name}.weight")
        n_out, n_in = _whole(cut, (n_out, n_in))
        pieces: dict[str | None, tuple[int, int]] = {None: (0, n_out)}
        for shard in FUSED_SHARDS.get(name.rsplit(".", 1)[-1], ()):
            pieces[shard] = (_whole_piece_rows(cut, shard) if isinstance(cut, Column) and len(cut.pieces) > 1
                             else shard_rows(model, f"{name}.weight", n_out, shard))
        targets[name] = LinearTarget(n_in, n_out, pieces, cut=cut)
    return targets


def _whole(cut, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A weight's shape before tensor parallelism split it (its own at one rank)."""
    return tuple(cut.full_shape(torch.Size(shape))) if isinstance(cut, (Column, Row)) else shape


def _whole_piece_rows(cut: Column, shard: str) -> tuple[int, int]:
    """(first row, rows) of piece `shard` in the whole fused weight: the pieces one after another."""
    first = 0
    for piece, split in cut.pieces.items():
        if piece == shard:
            return first, split.full
        first += split.full
    raise KeyError(shard)


@dataclass(frozen=True)
class AdapterPiece:
    module: str  # our module name
    shard: str | None  # the fused piece it adapts (None: the whole linear)
    rank: int
    scale: float  # lora_alpha / rank (rsLoRA: / sqrt(rank))
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pieces: tuple[AdapterPiece, ...]
    digest: str  # of the config and the weights file: tells two adapters of one name apart
    files: AdapterFiles | None = None  # what was read (its tensors' bytes when asked to keep them)
    root: str | None = None  # the --lora-dir folder a runtime load found it in

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest}"

    @property
    def towers(self) -> bool:
        return any(p.module.startswith(TOWER_PREFIXES) for p in self.pieces)

    @property
    def rank(self) -> int:
        return max((p.rank for p in self.pieces), default=0)  # 0: nothing on this part of the model


def _check_config(name: str, cfg: dict) -> dict:
    refused = {
        "peft_type": cfg.get("peft_type", "LORA") not in ("LORA", None),
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in ("none", None),
        "lora_bias": bool(cfg.get("lora_bias")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    for field, bad in refused.items():
        if bad:
            raise InvalidInputError(f"LoRA adapter {name!r}: {field}={str(cfg.get(field))[:80]} is not supported "
                                    "(plain LoRA on linear layers only: peft_type LORA, no DoRA, bias none, no "
                                    "modules_to_save)")
    patterns = cfg.get("alpha_pattern") or {}
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(field) or {}, dict):
            raise InvalidInputError(f"LoRA adapter {name!r}: {field} must be an object")
    if len(patterns) > MAX_PATTERNS or any(not isinstance(k, str) or len(k) > 256 for k in patterns):
        raise InvalidInputError(f"LoRA adapter {name!r}: alpha_pattern takes at most {MAX_PATTERNS} module names "
                                "of at most 256 characters")
    for field, alpha in [("lora_alpha", cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)), *patterns.items()]:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(_float(alpha)):
            raise InvalidInputError(f"LoRA adapter {name!r}: the alpha of {field} must be a number, got "
                                    f"{str(alpha)[:40]}")
    return cfg


def _float(value) -> float:
    try:
        return float(value)
    except (OverflowError, TypeError):  # an integer past float's range
        return math.inf


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module alphas: the first key that is the module's name or the end of it (`q_proj`,
    `layers.3.self_attn.q_proj`). Keys are matched as names, not run as regular expressions (a client's
    pattern must not cost unbounded time)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def read_adapter(name: str, folder: str | Path, targets: dict[str, LinearTarget], our_name, max_rank: int,
                 max_bytes: int, elsewhere: tuple[str, ...] = (), keep: bool = False,
                 roots: tuple[str, ...] | None = None, max_host_bytes: int | None = None,
                 itemsize: int = 4) -> AdapterSpec:
    """Reads an adapter's files once (vlserve.lora.files) and checks it against the model from its config and
    tensor header, before its tensors are read. `our_name`: the family's checkpoint-name mapping; `max_bytes`: the
    largest weights file accepted; `elsewhere`: prefixes of our modules another process holds (disaggregated
    serving): their pieces are left out here, its front end having checked them against the whole model. `keep`:
    the spec keeps the weights' bytes for `adapter_weights`. `roots`: a runtime load's --lora-dir folders.
    `max_host_bytes`: the host memory its weights may take (`itemsize` bytes a number: the model's dtype)."""
    checked: list[list[AdapterPiece]] = []

    def check(config: dict, tensors: dict) -> None:
        pieces = _pieces(name, _check_config(name, config), {k: e.shape for k, e in tensors.items()}, targets,
                         our_name, max_rank, elsewhere)
        need = host_bytes(pieces, targets, itemsize)
        if max_host_bytes is not None and need > max_host_bytes:
            raise InvalidInputError(f"LoRA adapter {name!r}: its weights take {need} bytes of host memory, more "
                                    f"than max_cpu_lora_memory_gb allows ({max_host_bytes})")
        checked.append(pieces)

    files = read_files(name, folder, max_bytes, keep, roots, check)
    for p in checked[0]:
        _check_weights(name, p, files.peaks[p.a_key], files.peaks[p.b_key] * abs(p.scale))
    return AdapterSpec(name, files.folder, tuple(checked[0]), files.digest, files if keep else None, files.root)


def _check_weights(name: str, piece: AdapterPiece, a_peak: float, b_peak: float) -> None:
    """Finite, and within MAX_WEIGHT (B as scaled by its alpha / rank): an absurd delta is refused by name, when the
    adapter is loaded (from the peaks measured as its bytes were read), never first by a request."""
    if not (math.isfinite(a_peak) and math.isfinite(b_peak)):
        raise InvalidInputError(f"LoRA adapter {name!r}: {piece.module} has non-finite weights")
    for which, peak in (("lora_A", a_peak), ("lora_B x lora_alpha / r", b_peak)):
        if peak > MAX_WEIGHT:
            raise InvalidInputError(f"LoRA adapter {name!r}: {piece.module}: {which} has entries over "
                                    f"{MAX_WEIGHT:g} in size: not a trained adapter (its deltas would overflow)")


def host_bytes(pieces, targets: dict[str, LinearTarget], itemsize: int) -> int:
    """The host memory `adapter_weights` makes of these pieces: per linear A [R, in] and B [out, R] (R: its pieces'
    ranks side by side), per MoE expert weight A [E, r, in] and B [E, out, r]."""
    ranks: dict[str, int] = {}
    for p in pieces:
        ranks[p.module] = ranks.get(p.module, 0) + p.rank
    numbers = sum(max(targets[m].experts, 1) * r * (targets[m].in_features + targets[m].out_features)
                  for m, r in ranks.items())
    return numbers * itemsize


def _pieces(name: str, cfg: dict, shapes: dict[str, tuple[int, ...]], targets: dict[str, LinearTarget], our_name,
            max_rank: int, elsewhere: tuple[str, ...]) -> list[AdapterPiece]:
    """The adapter's pairs checked against the model (from its config and the tensors' shapes alone)."""
    pairs: dict[str, dict[str, str]] = {}
    subs = set()
    for key in shapes:
        m = KEY.match(key)
        if m is None:
            raise InvalidInputError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a linear "
                                    "layer (embedding LoRA, DoRA magnitudes and trained biases are not supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
        subs.add(m["sub"])
    if len(subs) > 1:
        raise InvalidInputError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds several adapters "
                                f"({', '.join(sorted(map(str, subs)))}): save each in its own folder")
    if not pairs:
        raise InvalidInputError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    rslora = bool(cfg.get("use_rslora"))
    pieces = []
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise InvalidInputError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(ab))} but not its pair")
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        ours, shard = _our_module(module, our_name)
        if ours and ours.startswith(elsewhere):
            continue
        target = targets.get(ours) if ours else None
        if target is None:
            ours, module = _expert_weight(name, module, a, b, targets, our_name, pieces)
            target = targets.get(ours) if ours else None
        if target is None or shard not in target.pieces:
            raise InvalidInputError(f"LoRA adapter {name!r}: target module {module!r} is not a linear layer this "
                                    "model can adapt (decoder-layer and media-tower linears and MoE expert weights "
                                    "only; not the LM head, embeddings or convolutions)")
        ranks = max(target.experts, 1)  # an expert weight's pair holds every expert's ranks side by side
        rank = a[0] // ranks if len(a) == 2 and a[0] % ranks == 0 else 0
        rows = target.rows(shard)[1]
        if len(a) != 2 or len(b) != 2 or a[1] != target.in_features or b != (rows, rank * ranks) or rank < 1:
            what = f" of each of {target.experts} experts" if target.experts else ""
            raise InvalidInputError(f"LoRA adapter {name!r}: {module}: lora_A {list(a)} / lora_B {list(b)} do not "
                                    f"fit a linear of {target.in_features} -> {rows} features{what}")
        if rank > max_rank:
            raise InvalidInputError(f"LoRA adapter {name!r}: rank {rank} of {module} is over max_lora_rank "
                                    f"{max_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA))
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        pieces.append(AdapterPiece(ours, shard, rank, float(scale), ab["A"], ab["B"]))
    return pieces


def _our_module(module: str, our_name) -> tuple[str | None, str | None]:
    """(our module name, the fused piece) of a checkpoint module, through the family's name mapping."""
    mapped = our_name(f"{module}.weight")
    ours, shard = mapped if mapped is not None else (None, None)
    return (ours[: -len(".weight")] if ours and ours.endswith(".weight") else None), shard


def _expert_weight(name: str, module: str, a: tuple, b: tuple, targets: dict[str, LinearTarget], our_name,
                   pieces: list[AdapterPiece]) -> tuple[str | None, str]:
    """A pair PEFT saved for a 3-D MoE expert weight (under `<experts>.lora_A` or `<experts>.base_layer...`): our
    weight's name (None: no expert weight of that module fits its shapes) and the weight's checkpoint name (for
    messages and alpha_pattern). The weight is the one of the module whose (in, out) the pair's shapes fit."""
    unwrapped = PEFT_WRAPPERS.sub("", module)
    ours, _ = _our_module(unwrapped, our_name)
    if ours is None or len(a) != 2 or len(b) != 2:
        return None, module
    fits = [w for w, t in targets.items() if t.experts and w.rpartition(".")[0] == ours
            and (t.in_features, t.out_features) == (a[1], b[0])]
    if len(fits) != 1:
        return None, module
    weight = fits[0]
    if any(p.module == weight for p in pieces):
        raise InvalidInputError(f"LoRA adapter {name!r}: two pairs of {unwrapped!r} adapt its "
                                f"{weight.rpartition('.')[2]}")
    return weight, f"{unwrapped}.{weight.rpartition('.')[2]}"


def adapter_weights(spec: AdapterSpec, targets: dict[str, LinearTarget], dtype: torch.dtype,
                    device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted linear: (A [R, in], B [out, R]) with every piece's ranks side by side, B scaled and zero
    outside each piece's rows, so one pair of products gives the whole linear's delta. Per adapted MoE expert
    weight: (A [E, r, in], B [E, out, r]), B scaled: expert e's delta is B[e] A[e]. Whole pairs, before tensor
    parallelism cuts them (`this_ranks_part`). From the bytes `read_adapter(..., keep=True)` read."""
    if spec.files is None or spec.files.data is None:
        raise RuntimeError(f"LoRA adapter {spec.name!r}: read without its weights (read_adapter keep=True)")
    by_module: dict[str, list[AdapterPiece]] = {}
    for piece in spec.pieces:
        by_module.setdefault(piece.module, []).append(piece)
    out = {}
    f = spec.files
    for module, pieces in by_module.items():
        target = targets[module]
        if target.experts:  # one piece: the whole 3-D weight (read_adapter refuses a second)
            p, n = pieces[0], target.experts
            # a copy even when float32 already: a view would keep the whole file's bytes alive with it
            a = f.tensor(p.a_key).to(torch.float32, copy=True).reshape(n, p.rank, target.in_features)
            b = f.tensor(p.b_key).float().reshape(target.out_features, p.rank, n).permute(2, 0, 1) * p.scale
            out[module] = (a.to(device=device, dtype=dtype), b.contiguous().to(device=device, dtype=dtype))
            continue
        total = sum(p.rank for p in pieces)
        a = torch.empty(total, target.in_features, dtype=torch.float32)
        b = torch.zeros(target.out_features, total, dtype=torch.float32)
        col = 0
        for p in pieces:
            first, rows = target.rows(p.shard)
            a[col : col + p.rank] = f.tensor(p.a_key).float()
            b[first : first + rows, col : col + p.rank] = f.tensor(p.b_key).float() * p.scale
            col += p.rank
        out[module] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return out


def this_ranks_part(cut, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole pair cut as its weight was (`cut`: the target's rule): a column-parallel weight keeps its output
    rows (B's rows, each fused piece on its own), a row-parallel one its input features (A's columns; each rank's
    partial delta is summed with its partial output by the layer's all-reduce). Contiguous: the slots keep them."""
    if isinstance(cut, Column):
        b = cut.local(b, None)
    elif isinstance(cut, Row):
        a = cut.local(a, None)
    return a.contiguous(), b.contiguous()
