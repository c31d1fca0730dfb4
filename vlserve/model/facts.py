"""The model facts every process of a server must agree on, resolved once and shipped as a typed message.

A front end resolves them from the checkpoint's config.json (no weights loaded): where the files are, the
architecture and its sizes, vocabulary, eos and media token ids, the dtype and device the engine computes in,
and the context length. The engine process (and every tensor-parallel rank it starts) receives them with its
options and uses them as they are, so the front end's prompt checks and the engine's model cannot disagree
(e.g. a config.json edited between the two start-ups, or a hub id resolved to another snapshot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec
import torch

from vlserve.core.config import EngineArgs
from vlserve.core.errors import ConfigurationError
from vlserve.model.checkpoint_path import resolve_model_path
from vlserve.model.encoder_budgets import DEFAULT_ENCODER_BUDGET, encoder_budgets, media_bounds_of
from vlserve.model.gemm_rates import cached_rates
from vlserve.model.hardware import DTYPES, pick_device, resolve_dtype
from vlserve.model.hf_config import ModelConfig, load_model_config

DEFAULT_MAX_MODEL_LEN_CAP = 32768  # without --max-model-len: the model's own context, at most this


class ModelFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_path: str  # the local checkpoint folder (a hub id already fetched)
    model: ModelConfig  # config.json, parsed
    dtype: Literal["float32", "bfloat16", "float16"]  # what the engine computes in
    device: str  # "cpu", "cuda", "cuda:1": where the engine runs (rank 0 under tensor parallelism)
    max_model_len: int  # longest prompt + output in tokens
    # the encoder's budgets (vlserve.model.encoder_budgets): cache rows, and tokens per step (the largest item)
    encoder_cache_size: int = DEFAULT_ENCODER_BUDGET
    max_num_encoder_input_tokens: int = DEFAULT_ENCODER_BUDGET

    @property
    def path(self) -> Path:
        return Path(self.model_path)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def resolve_model_facts(args: EngineArgs, announce: bool = True, runs_model: bool = True,
                        media: dict | None = None) -> ModelFacts:
    """From the options and config.json. `announce`: log the dtype decision (the process that resolves them
    does; the processes they are shipped to do not resolve them again). `runs_model`: False for a process that
    only reads the config (a router): dtype auto then follows the CPU's flags, with no GEMM measured. `media`:
    the server's media bounds (`ServerArgs.media_bounds()`; None: their defaults), which size the encoder's."""
    args.check()
    path = resolve_model_path(args.model)
    model = load_model_config(path)
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, model.checkpoint_dtype, device, announce and runs_model,
                          measure=cached_rates if runs_model else None)
    max_model_len = args.max_model_len or min(model.text.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    name = next(k for k, v in DTYPES.items() if v == dtype)
    cache, step = encoder_budgets(args, model, path, media_bounds_of(args, media))
    return ModelFacts(str(path), model, name, str(device), max_model_len, cache, step)


def encode_facts(facts: ModelFacts) -> bytes:
    return msgspec.json.encode(facts)


def decode_facts(data: bytes | str) -> ModelFacts:
    """Raises ConfigurationError when the message is not the facts this version ships (a mixed install)."""
    try:
        return msgspec.json.decode(data, type=ModelFacts)
    except msgspec.DecodeError as e:
        raise ConfigurationError(f"the model facts sent to this process do not decode ({e}); are both processes "
                                 "the same vlserve version?") from None
