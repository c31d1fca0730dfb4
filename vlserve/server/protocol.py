"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated by pydantic.

Unknown fields are accepted and ignored, as OpenAI does. Value checks (ranges, stop strings, ...) live in
`SamplingParams` so the offline API and the server refuse exactly the same things.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vlserve.core.errors import InvalidInputError
from vlserve.core.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidInputError("stream_options is only allowed when stream is true")
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output)
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty)
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInputError("top_logprobs needs logprobs to be true")
        if not self.logprobs:
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= MAX_LOGPROBS:
            raise InvalidInputError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {k}")
        return k


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[dict]:
        """Each prompt as an engine prompt dict: text, or token ids."""
        if self.echo or self.suffix:
            raise InvalidInputError("echo and suffix are not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidInputError("best_of must equal n (best-of sampling is not supported)")
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise InvalidInputError("prompt must not be empty")
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in items]
