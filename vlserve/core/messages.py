"""Typed messages that leave the engine core (msgspec, so they can cross a process boundary unchanged)."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token: the sampled token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (or, set by the front end, the stop string)
    num_cached_tokens: int = 0


class Handoff(msgspec.Struct):
    """What a prefill instance hands a decode instance beside the prompt's KV: the output of its one step (the
    first token, with its logprobs) and the seeded request's random-generator state after that draw."""

    first: EngineCoreOutput
    generator_state: bytes | None = None
