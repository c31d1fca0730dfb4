"""A request inside the engine core: its tokens, multimodal items, progress and KV blocks."""

from __future__ import annotations

import enum
import time

import torch

from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence being generated: a processed prompt plus one sample's parameters and progress."""

    def __init__(self, request_id: str, prompt: ProcessedPrompt, sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt  # shared by the n samples of one API request; never modified
        self.prompt_token_ids = prompt.prompt_token_ids
        self.token_ids = list(prompt.prompt_token_ids)  # prompt + generated, grows each step
        self.num_prompt_tokens = len(prompt.prompt_token_ids)
        self.params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.mm_items = prompt.mm_items
        self.media_end = max((it.end for it in self.mm_items), default=0)  # no media item past this token
        self.lora = prompt.lora
        self.positions = prompt.positions
        self.position_delta = prompt.position_delta
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens being sampled on the device, not read yet (async scheduling: up to 2)
        # only ever extended in place; any other change assigns a new list (engine.block_tables relies on it)
        self.block_ids: list[int] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None  # set by the runner when params.seed is given
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of full blocks (see cache.block_hash)
        self.block_keys: list[tuple] = []  # the content each of those hashes stands for
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.grammar = None  # the engine's RequestGrammar when params.structured_outputs is set

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def items_overlapping(self, start: int, end: int) -> list[int]:
        """Indices of mm items whose placeholder intersects token range [start, end)."""
        if start >= self.media_end:  # (every decode step: once per running request and more)
            return []
        return [i for i, it in enumerate(self.mm_items) if it.offset < end and it.end > start]

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
