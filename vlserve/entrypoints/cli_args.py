"""Engine flags on the command line, generated from EngineArgs so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses

from vlserve.config import EngineArgs

HELP = {
    "dtype": "weights/activations dtype: auto (checkpoint's), float32, bfloat16, float16",
    "device": "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...",
    "max_model_len": "longest prompt + output in tokens (default: the model's, capped at 32768)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks + decode tokens)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory_gb": "KV cache size in GiB (default 2, capped at what max_num_seqs x max_model_len needs)",
    "num_kv_blocks": "KV cache size in blocks (overrides --kv-cache-memory-gb)",
    "encoder_cache_size": "encoder cache capacity in embedding tokens (0 disables)",
    "max_num_encoder_input_tokens": "most embedding tokens encoded in one step",
    "disable_chunked_mm_input": "never split an image's placeholder run across steps",
    "limit_mm_per_prompt": "most items per prompt, e.g. image=8,video=1",
    "max_video_frames": "most frames sampled from one video (a request may ask for fewer via mm_processor_kwargs)",
    "enable_mm_embeds": "accept precomputed image embeddings (image_embeds parts / multi_modal_data)",
    "seed": "engine seed",
}


def parse_limits(text: str) -> dict[str, int]:
    limits = {}
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        if not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected kind=N pairs like image=8,video=1, got '{part}'")
        limits[kind.strip()] = int(value)
    return limits


NOT_FLAGS = {"load_vision"}  # set by the role a process plays, not by users


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name in NOT_FLAGS:
            continue
        if f.name == "model":
            parser.add_argument(flag, required=model_required, default=None, help="model folder or hub id")
        elif f.name == "enable_prefix_caching":
            parser.add_argument("--disable-prefix-caching", dest=f.name, action="store_false",
                                help="turn off automatic prefix caching")
        elif f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=HELP.get(f.name))
        elif f.name == "limit_mm_per_prompt":
            parser.add_argument(flag, type=parse_limits, default=None, help=HELP.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" | ")[0], str)
            parser.add_argument(flag, type=kind, default=None, help=HELP.get(f.name))


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    """Only flags the user gave override EngineArgs' defaults."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if getattr(ns, f.name, None) is not None}
    if getattr(ns, "enable_prefix_caching", True) is False:
        values["enable_prefix_caching"] = False
    values.update(overrides)
    return EngineArgs(**values)
