"""Per-request sampling parameters, with vLLM's field names and defaults.

A msgspec Struct so the same object can be encoded and sent to another process
(engine core, workers) without a custom serializer.
"""

from __future__ import annotations

import math

import msgspec

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import StructuredOutputsParams, structured_outputs_from

# Temperatures below this are treated as greedy decoding (same threshold as vLLM).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every integer must cross process boundaries as an int64


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off; normalised to 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to a list (possibly empty)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict with the same fields is accepted too

    def __post_init__(self) -> None:
        # Consumers always see a list, so they never branch on str/None.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.top_k == -1:
            self.top_k = 0  # one spelling of "off" keeps the sampler simple
        self.structured_outputs = structured_outputs_from(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        # Comparisons are written as `not (x ok)` so NaN is rejected too.
        if not (_is_int(self.n) and self.n >= 1):
            _bad(f"n must be an integer >= 1, got {self.n!r}")
        if not (_is_num(self.temperature) and 0 <= self.temperature < math.inf):
            _bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            _bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and 0 <= self.top_k <= INT64_MAX):
            _bad(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not (_is_num(self.min_p) and 0 <= self.min_p <= 1):
            _bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            _bad(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX):
            _bad(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= INT64_MAX):
            _bad(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_num(value) and -2 <= value <= 2):
                _bad(f"{name} must be in [-2, 2], got {value!r}")
        if not (_is_num(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf):
            _bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            _bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _bad(f"stop strings must be non-empty strings, got {s!r}")
            if not _is_utf8(s):
                _bad("stop strings must be valid unicode (no lone surrogates)")
        if self.stop_token_ids is not None:
            for t in self.stop_token_ids:
                if not (_is_int(t) and 0 <= t <= INT64_MAX):
                    _bad(f"stop_token_ids must be non-negative 64-bit integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def for_prefill(self) -> "SamplingParams":
        """What a prefill instance runs: the first token only, drawn exactly as the whole request would draw it
        (same seed, penalties, grammar; EOS blocked if min_tokens says so)."""
        return msgspec.structs.replace(self, n=1, max_tokens=1, min_tokens=min(self.min_tokens, 1))


def _bad(message: str) -> None:
    raise InvalidInputError(message)


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fan_out(params: SamplingParams, request_id: str) -> list[tuple[str, SamplingParams]]:
    """One API request with n samples -> (id, params) of its n engine sequences ("i_<id>" when n > 1).

    Seeded samples get seed, seed+1, ... (wrapping within int64), so they differ but reproduce.
    """
    one = msgspec.structs.replace(params, n=1)
    if params.n == 1:
        return [(request_id, one)]
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i - INT64_MIN) % 2**64 + INT64_MIN
        out.append((f"{i}_{request_id}", msgspec.structs.replace(one, seed=seed)))
    return out
