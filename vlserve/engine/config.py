"""Engine arguments resolved into a config: the model facts (files, dtype, device, context length; see
vlserve.model.facts) as the front end resolved them, cache sizes final."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vlserve.core.config import DEFAULT_MAX_CPU_LORAS, TOWERS, EngineArgs
from vlserve.core.errors import ConfigurationError, InvalidInputError
from vlserve.engine.decode_graphs import default_sizes
from vlserve.engine.transfer_buffers import shm_dir, sweep_stale_files
from vlserve.model.facts import ModelFacts, resolve_model_facts
from vlserve.model.hardware import memory_available_bytes
from vlserve.model.config_types import ModelConfig
from vlserve.model.layers.linear_state import state_bytes_per_slot
from vlserve.model.loader import weight_files
from vlserve.model.quantization import QuantizationConfig, resolve_quantization

logger = logging.getLogger("vlserve.engine")
WEIGHTS, DATA = "weights", "data"  # mm_encoder_tp_mode
MIN_DEFAULT_KV_BYTES = 256 * 2**20  # the default KV cache is as large as the weights, and at least this
CPU_FREE_MEMORY_SHARE = 0.5  # of what is free after the weights, the default KV cache takes at most this share
GPU_FREE_MEMORY_SHARE = 0.9
EAGER_ENV = "VLSERVE_ENFORCE_EAGER"
ASYNC_ENV = "VLSERVE_ASYNC_SCHEDULING"


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # device slots: adapters one step may run
    max_cpu_loras: int  # adapters kept in host memory
    max_rank: int
    max_cpu_bytes: int | None = None  # ... and the bytes they may take there


@dataclass(frozen=True)
class VlserveConfig:
    """Everything the engine needs, resolved: paths, dtype, device and cache sizes are final here. `model_path`,
    `model`, `dtype`, `device` and `max_model_len` are `facts`' own, in torch's types."""

    model_path: Path
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    quantization: QuantizationConfig | None
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
    facts: ModelFacts
    load_language: bool = True
    towers: tuple[str, ...] = ()  # the media towers loaded: those the model has, or an encoder's --towers
    tensor_parallel_size: int = 1
    mm_encoder_tp_mode: str = WEIGHTS
    args: EngineArgs | None = None  # what it was resolved from (sent, with `facts`, to the other tensor-parallel ranks)
    # Hybrid models (linear-attention layers): prefix-cache snapshots of per-sequence states; 0 otherwise.
    num_state_snapshots: int = 0
    graph_sizes: tuple[int, ...] = ()  # decode batch sizes run from captured graphs (engine.decode_graphs); () none
    enforce_eager: bool = False  # no graphs at all (decode, vision tower)
    async_scheduling: bool = False  # the next step is scheduled while the device runs this one (engine.core)
    lora: LoRAConfig | None = None  # serving LoRA adapters (vlserve.lora); None: off
    # The KV cache in shared files, one per rank (see `kv_cache_shared`): a decode engine's, which its peers write
    # prompts' KV into; a prefill engine's at several ranks, which rank 0's writer thread reads.
    kv_cache_file: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        """Per rank (each caches its share of the key/value heads)."""
        return kv_bytes_per_token(self.model, self.dtype, self.tensor_parallel_size)

    @property
    def num_state_slots(self) -> int:
        """Linear-attention state slots: one per running sequence, then the snapshots (0: not a hybrid model)."""
        return self.max_num_seqs + self.num_state_snapshots if self.model.is_hybrid else 0

    @property
    def state_bytes(self) -> int:
        """The whole state pool, per rank."""
        return self.num_state_slots * state_bytes_per_slot(self.model.text, self.dtype, self.tensor_parallel_size)


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype, ranks: int = 1) -> int:
    """Per rank: under tensor parallelism each rank caches its share of the key/value heads (at least one).
    Linear-attention layers keep no KV (their per-sequence states are counted by `state_pool_bytes`)."""
    t = model.text
    heads = max(t.num_kv_heads // ranks, 1)
    layers = sum(not t.is_linear_layer(i) for i in range(t.num_layers))
    return 2 * layers * heads * t.head_dim * torch.empty((), dtype=dtype).element_size()


def num_state_snapshots(args: EngineArgs, model: ModelConfig) -> int:
    """Snapshot slots of a hybrid model: none without prefix caching (nothing would ever look them up)."""
    return args.max_state_snapshots if model.is_hybrid and args.enable_prefix_caching else 0


def state_pool_bytes(args: EngineArgs, model: ModelConfig, dtype: torch.dtype) -> int:
    """Per rank: running slots (max_num_seqs) plus snapshot slots, every linear layer; 0 for other models."""
    if not model.is_hybrid:
        return 0
    slots = args.max_num_seqs + num_state_snapshots(args, model)
    return slots * state_bytes_per_slot(model.text, dtype, args.tensor_parallel_size)


def check_tensor_parallel(args: EngineArgs, model: ModelConfig, quantization: QuantizationConfig | None,
                          device: torch.device) -> None:
    """Refuses at once what the ranks could not split evenly (rather than when every rank loads)."""
    tp = args.tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidInputError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if args.mm_encoder_tp_mode not in (WEIGHTS, DATA):
        raise InvalidInputError(f"mm_encoder_tp_mode must be '{WEIGHTS}' or '{DATA}', got {args.mm_encoder_tp_mode!r}")
    if tp == 1:
        return
    la = model.text.linear_attention if args.load_language else None
    if la is not None and (la.num_key_heads % tp or la.num_value_heads % tp):
        raise InvalidInputError(f"tensor parallelism: the linear-attention heads ({la.num_key_heads} key, "
                                f"{la.num_value_heads} value) are not divisible by tensor_parallel_size {tp}")
    if device.type == "cuda":
        if device.index is not None:
            raise InvalidInputError("with tensor_parallel_size > 1 rank r runs on cuda:r (of CUDA_VISIBLE_DEVICES); "
                                    f"pass --device cuda, not {device}")
        if torch.cuda.device_count() < tp:
            raise InvalidInputError(f"tensor_parallel_size {tp} needs {tp} CUDA devices on this machine, "
                                    f"{torch.cuda.device_count()} are visible")
    if quantization is not None and quantization.is_checkpoint_format:
        raise InvalidInputError(f"{quantization.method.upper()} 4-bit checkpoints cannot be split over ranks: use "
                                "tensor_parallel_size 1, or int8 from the full-precision checkpoint")
    t, v = model.text, model.vision
    sizes = {}
    if args.load_language:
        sizes |= {"attention heads": t.num_heads, "MLP width": t.intermediate_size, "the intermediate size of "
                  "the experts": t.moe.intermediate_size if t.moe else tp}
    if args.mm_encoder_tp_mode == WEIGHTS and "vision" in loaded_towers(args, model):  # audio: whole per rank
        sizes |= {"vision attention heads (try mm_encoder_tp_mode data)": v.num_heads,
                  "vision MLP width (try mm_encoder_tp_mode data)": v.mlp_hidden}
    for what, n in sizes.items():
        if n % tp:
            raise InvalidInputError(f"tensor_parallel_size {tp} does not divide the model's {what} ({n})")
    if not args.load_language:
        return
    kv = t.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise InvalidInputError(f"tensor_parallel_size {tp} cannot share the model's {kv} key/value heads evenly")


def loaded_towers(args: EngineArgs, model: ModelConfig) -> tuple[str, ...]:
    """The media towers this instance loads: none without `load_vision`, else `args.towers` (an encoder's choice;
    a tower the model lacks is refused) or every tower the model has."""
    has = tuple(t for t in TOWERS if getattr(model, t) is not None)
    if not args.load_vision:
        return ()
    if not args.towers:
        return has
    lacking = [t for t in args.towers if t not in has]
    if lacking:
        raise InvalidInputError(f"this model has no {' or '.join(lacking)} tower (it has: {', '.join(has) or 'none'})")
    return tuple(t for t in TOWERS if t in args.towers)


SHARED_KV_SHARE = 0.9  # of the shared-memory folder's free space an automatic KV cache there may take


def fit_kv_in_shared_memory(cfg: VlserveConfig) -> VlserveConfig:
    """A KV cache sized automatically (no --num-kv-blocks, no --kv-cache-memory-gb) that goes into a shared file
    gets no more than `SHARED_KV_SHARE` of the free space where that file goes (a container's /dev/shm may be far
    smaller than its memory). A size the user set is left as it is: too big, it stops the start with a clear
    error (TransferBuffers.create)."""
    args = cfg.args
    if args is None or args.num_kv_blocks is not None or args.kv_cache_memory_gb is not None:
        return cfg
    most = shared_kv_blocks_room(cfg)
    if most >= cfg.num_kv_blocks:
        return cfg
    if most < 2:
        raise ConfigurationError(f"the shared-memory folder {shm_dir() or tempfile.gettempdir()} has no room for "
                                 "a KV cache; give it more (a container's --shm-size)")
    logger.warning("the KV cache goes into shared memory, which has room for %d of the %d blocks it would have "
                   "had: %d blocks (give /dev/shm more room, e.g. a container's --shm-size, for more)", most,
                   cfg.num_kv_blocks, most)
    if most * cfg.block_size < cfg.max_model_len:
        logger.warning("that is less than one sequence of --max-model-len %d tokens: longer prompts are refused",
                       cfg.max_model_len)
    return dataclasses.replace(cfg, num_kv_blocks=most)


def shared_kv_blocks_room(cfg: VlserveConfig) -> int:
    """KV blocks `SHARED_KV_SHARE` of the shared-memory folder's free space holds, every rank's file counted (each
    rank keeps its own heads: `kv_bytes_per_token` is one rank's)."""
    folder = shm_dir() or tempfile.gettempdir()
    sweep_stale_files(folder)  # a crashed engine's KV file is no room taken
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    per_block = cfg.kv_bytes_per_token * cfg.block_size * cfg.tensor_parallel_size
    return int(free * SHARED_KV_SHARE) // per_block - 1  # - 1: the scratch block


def resolve_config(args: EngineArgs, facts: ModelFacts | None = None, announce: bool = True) -> VlserveConfig:
    """`facts`: as a front end resolved them (used as they are); None: resolved here, from `args`. `announce`:
    log the dtype decision when resolving them."""
    args.check()
    facts = facts or resolve_model_facts(args, announce)
    path, model_cfg, max_model_len = facts.path, facts.model, facts.max_model_len
    device, dtype = facts.torch_device, facts.torch_dtype
    quantization = resolve_quantization(args.quantization, model_cfg.quantization)
    check_tensor_parallel(args, model_cfg, quantization, device)
    lora = lora_config(args)
    # an encode service has no KV cache
    num_blocks = _num_kv_blocks(args, path, model_cfg, dtype, device, max_model_len) if args.load_language else 0
    return VlserveConfig(
        model_path=path, model=model_cfg, dtype=dtype, device=device, quantization=quantization,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=num_blocks, enable_prefix_caching=args.enable_prefix_caching,
        encoder_cache_size=facts.encoder_cache_size, max_num_encoder_input_tokens=facts.max_num_encoder_input_tokens,
        disable_chunked_mm_input=args.disable_chunked_mm_input, limit_mm_per_prompt=args.mm_limits(),
        max_video_frames=args.max_video_frames, enable_mm_embeds=args.enable_mm_embeds, seed=args.seed,
        load_vision=args.load_vision, facts=facts, load_language=args.load_language,
        towers=loaded_towers(args, model_cfg),
        tensor_parallel_size=args.tensor_parallel_size, mm_encoder_tp_mode=args.mm_encoder_tp_mode, args=args,
        num_state_snapshots=num_state_snapshots(args, model_cfg) if args.load_language else 0,
        # LoRA deltas are computed per step from the slots in use: no graphs (decode or vision) with adapters
        graph_sizes=decode_graph_sizes(args, device) if args.load_language and lora is None else (),
        enforce_eager=eager(args) or lora is not None, async_scheduling=async_scheduling(args, device), lora=lora,
    )


def lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    if not (args.load_language or args.load_vision):
        raise InvalidInputError("enable_lora needs the language model or a media tower loaded")
    # A part of the model (an encoder's towers, a language server's LM) adapts its own linears only: the slots
    # leave the adapter's other modules to the process that holds them. With tensor parallelism each rank holds
    # its part of every adapter, cut as its weights are (vlserve.lora.adapter).
    cpu_loras = args.max_cpu_loras or max(2 * args.max_loras, DEFAULT_MAX_CPU_LORAS)
    return LoRAConfig(args.max_loras, max(cpu_loras, args.max_loras), args.max_lora_rank,
                      args.lora_host_bytes())


def async_scheduling(args: EngineArgs, device: torch.device) -> bool:
    """On for one CUDA rank unless turned off. A CPU gains nothing (its host is the device), so it stays off there
    unless VLSERVE_ASYNC_SCHEDULING=1 forces it (the tests do, to check its logic on any machine)."""
    forced = os.environ.get(ASYNC_ENV, "") == "1"
    return args.async_scheduling and args.tensor_parallel_size == 1 and (device.type == "cuda" or forced)


def eager(args: EngineArgs) -> bool:
    """--enforce-eager, or VLSERVE_ENFORCE_EAGER=1 (one switch for a whole test run, through any entry point)."""
    return args.enforce_eager or os.environ.get(EAGER_ENV, "") == "1"


def decode_graph_sizes(args: EngineArgs, device: torch.device) -> tuple[int, ...]:
    """The decode batch sizes to capture: none with enforce_eager; the user's (capped at max_num_seqs); by
    default on CUDA 1, 2, 4, 8, then multiples of 8 up to min(max_num_seqs, 256), and none on a CPU."""
    if eager(args):
        return ()
    if args.cuda_graph_sizes is not None:
        return tuple(sorted({min(n, args.max_num_seqs) for n in args.cuda_graph_sizes}))
    return default_sizes(args.max_num_seqs) if device.type == "cuda" else ()


def _num_kv_blocks(args: EngineArgs, path: Path, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                   max_model_len: int) -> int:
    per_block = kv_bytes_per_token(model_cfg, dtype, args.tensor_parallel_size) * args.block_size
    if not per_block:
        raise ConfigurationError(f"{model_cfg.architecture}: no full-attention layer (nothing to cache KV for)")
    states = state_pool_bytes(args, model_cfg, dtype)  # taken out of the memory budget first
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        if args.kv_cache_memory_gb is not None:
            budget = int(args.kv_cache_memory_gb * 2**30)
        else:
            budget = default_kv_bytes(args, path, model_cfg, dtype, device, max_model_len, states)
        num_blocks = (budget - states) // per_block
        if states and num_blocks < 2:
            raise InvalidInputError(
                f"the linear-attention state pool ({states / 2**30:.2f} GiB: max_num_seqs {args.max_num_seqs} + "
                f"{num_state_snapshots(args, model_cfg)} snapshots) leaves no room for the KV cache in "
                f"{budget / 2**30:.2f} GiB; raise kv_cache_memory_gb, or lower max_num_seqs or max_state_snapshots")
    if num_blocks < 2:
        raise InvalidInputError(f"KV cache too small: {num_blocks} blocks; raise kv_cache_memory_gb or num_kv_blocks")
    return num_blocks


def default_kv_bytes(args: EngineArgs, path: Path, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     max_model_len: int, state_bytes: int = 0) -> int:
    """KV cache bytes (with a hybrid model's `state_bytes`, the state pool on top, inside the same memory bounds)
    when the user set no size.

    Scaled to the model (as large as its weights, at least MIN_DEFAULT_KV_BYTES), never more than every sequence
    at full length needs (max_num_seqs x max_model_len), bounded by a share of the memory left after the weights,
    and never less than one sequence at full length (else long requests could never run).
    """
    ranks = args.tensor_parallel_size
    per_token = kv_bytes_per_token(model_cfg, dtype, ranks)  # all figures per rank
    need = args.max_num_seqs * max_model_len * per_token + state_bytes
    one_sequence = max_model_len * per_token + state_bytes
    weights = _weight_bytes(path, model_cfg, dtype) // ranks  # about: a data-parallel vision tower is whole
    budget = max(weights, MIN_DEFAULT_KV_BYTES) + state_bytes  # the KV part sized as for any model
    available = memory_available_bytes(device)
    if available is not None:
        share = GPU_FREE_MEMORY_SHARE if device.type == "cuda" else CPU_FREE_MEMORY_SHARE
        if device.type == "cuda":  # a device per rank
            budget = int(max(available - weights, 0) * share)
        else:  # the ranks of a machine share its memory
            budget = min(budget, int(max(available - weights * ranks, 0) * share) // ranks)
    kv = max(min(need, budget), one_sequence)
    if available is not None and kv > available - weights:
        logger.warning("the KV cache for one %d-token sequence (%.2f GiB) exceeds the free memory; lower "
                       "max_model_len", max_model_len, one_sequence / 2**30)
    return kv


def _weight_bytes(path: Path, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Weight bytes once loaded in `dtype` (the files may hold another dtype)."""
    try:
        stored = sum(f.stat().st_size for f in weight_files(path))
    except Exception:  # noqa: BLE001 - a missing file is reported by the loader; here it only sizes a default
        return 0
    file_itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(model_cfg.checkpoint_dtype or "", 4)
    return stored * torch.empty((), dtype=dtype).element_size() // file_itemsize

