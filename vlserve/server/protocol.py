"""Request bodies of the OpenAI API (plus vLLM's extra fields), parsed strictly.

Bodies are decoded with msgspec (standard JSON only: no NaN/Infinity, no lone surrogates) and validated by
pydantic in strict mode: no bool taken as a number, no "2" taken as 2. Value checks (ranges, stop strings, ...)
live in `SamplingParams`, so the offline API and the server refuse exactly the same things.

A field that would change what the answer must be (`logit_bias`, `functions`, ...) is refused with a 400 until
vlserve implements it, never silently ignored; any other unknown field is logged once as ignored, like vLLM does.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import msgspec
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from vlserve.core.config import ServerArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from vlserve.core.structured_outputs import StructuredOutputsError, StructuredOutputsParams, structured_outputs_from
from vlserve.frontend.tool_calls import ToolChoice, call_grammar, check_tool_choice, check_tools
from vlserve.server.errors import describe_validation

logger = logging.getLogger("vlserve.server")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _set(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {}


# Fields whose value, when set, changes what a correct answer is. Refused until implemented.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": _set,
    "function_call": lambda v: v not in (None, "none", "auto"),
    "logit_bias": _set,
    "guided_decoding_backend": _set,
    "structural_tag": _set,
    "prompt_logprobs": _set,
    "use_beam_search": _set,
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "allowed_token_ids": _set,
    "bad_words": _set,
    "truncate_prompt_tokens": _set,
    "return_tokens_as_token_ids": _set,
    "audio": _set,
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": _set,
    "echo": _set,
    "suffix": _set,
    "documents": _set,
    "continue_final_message": _set,
}
_logged_ignored: set[str] = set()


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

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
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Which of the spellings above gave the output constraint: errors about it name the field the client sent.
    _constraint_source: str = PrivateAttr(default="structured_outputs")
    # What response_format is called where the client wrote it: "text.format" in a Responses request.
    _format_field: str = PrivateAttr(default="response_format")

    def set_format_field(self, name: str) -> None:
        self._format_field = name

    def check_fields(self, server: ServerArgs) -> None:
        """Refuse what cannot be honoured; log (once per name) unknown fields that change nothing."""
        for name, value in (self.model_extra or {}).items():
            refuse = UNSUPPORTED.get(name)
            if refuse is not None and refuse(value):
                raise InvalidInputError(f"'{name}' is not supported by this server yet; remove it from the request")
            if refuse is None and name not in _logged_ignored and len(_logged_ignored) < 1000:
                _logged_ignored.add(name)
                logger.warning("the request field %r is not used by vlserve and was ignored", name[:64])
        if self.n > server.max_n:
            raise InvalidInputError(f"n must be at most {server.max_n} (--max-n), got {self.n}")
        # Bounded before any work: each stop string is checked against the output after every token.
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for name, items in (("stop", stops), ("stop_token_ids", self.stop_token_ids or [])):
            if len(items) > server.max_stop_strings:
                raise InvalidInputError(f"{name} may hold at most {server.max_stop_strings} entries "
                                        f"(--max-stop-strings), got {len(items)}")
        longest = max(stops, key=len, default="")
        if len(longest) > server.max_stop_string_chars:
            raise InvalidInputError(f"a stop string may be at most {server.max_stop_string_chars} characters long "
                                    f"(--max-stop-string-chars), got one of {len(longest)}")
        if self.stream_options is not None and not self.stream:
            raise InvalidInputError("stream_options is only allowed when stream is true")
        if self.request_id is not None and not REQUEST_ID.match(self.request_id):
            raise InvalidInputError("request_id must be 1-128 characters of letters, digits and ._:-")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params())
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty)
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint, from whichever one of the three spellings the request used."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        given = {}
        for source, value, convert in (("structured_outputs", self.structured_outputs, structured_outputs_from),
                                       (self._format_field, self.response_format, _response_format),
                                       ("guided_*", guided or None, structured_outputs_from)):
            if value is not None:
                try:
                    spec = convert(value)
                except StructuredOutputsError as e:
                    raise e.for_field(_client_field(source, e.kind)) from None
                if spec is not None:
                    given[source] = spec
        if len(given) > 1:
            raise InvalidInputError(f"give one output constraint, not {' and '.join(given)}")
        self._constraint_source = next(iter(given), "structured_outputs")
        return next(iter(given.values()), None)

    def constraint_error(self, error: StructuredOutputsError) -> StructuredOutputsError:
        """`error`, about this request's output constraint, naming the field the client gave it in."""
        return error.for_field(_client_field(self._constraint_source, error.kind))


def _client_field(source: str, kind: str) -> str:
    """The request field, as the client wrote it, that gave a constraint of `kind` from `source`."""
    if source == "response_format":
        return "response_format.json_schema.schema" if kind == "json" else "response_format"
    if source == "text.format":
        return "text.format.schema" if kind == "json" else "text.format"
    if source == "guided_*":
        return f"guided_{kind}"
    if source == "tools":
        return "tools[].function.parameters"
    return f"structured_outputs.{kind}"


def _response_format(value: dict) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise InvalidInputError("response_format.json_schema must be an object with a 'name' and a 'schema'")
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise InvalidInputError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise InvalidInputError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                            "'json_schema'")


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def tool_setup(self) -> tuple[list[dict], ToolChoice]:
        """The offered tools and how they may be used; with tool_choice "none" no tools are offered."""
        tools = check_tools(self.tools)
        choice = check_tool_choice(self.tool_choice, tools)
        return ([] if choice.mode == "none" else tools), choice

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        constraint = super().structured_outputs_params()
        tools, choice = self.tool_setup()
        forced = call_grammar(tools, choice, self.parallel_tool_calls)
        if forced is not None and constraint is not None:
            raise InvalidInputError("tool_choice 'required' or a named function already fixes the output's form; "
                                    "it cannot be combined with response_format or structured_outputs")
        if forced is not None:
            self._constraint_source = "tools"  # the grammar of the calls: only the tools' schemas can break it
        return forced or constraint

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
    best_of: int | None = None

    def prompts(self) -> list[dict]:
        """Each prompt as an engine prompt dict: text, or token ids."""
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


_decoder = msgspec.json.Decoder()


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> a validated request; every way it can be wrong is an InvalidInputError (400)."""
    try:
        data = _decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidInputError(f"the request body is not valid JSON ({e}); NaN, Infinity and lone surrogates "
                                "are not JSON") from None
    except UnicodeDecodeError as e:  # msgspec checks the UTF-8 of strings only when it decodes them
        raise InvalidInputError(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise InvalidInputError("the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise InvalidInputError("the request body must be a JSON object")
    return validate(model, data)


def validate(model: type[BaseModel], data: dict) -> Any:
    """`data` as a `model`; a wrong value is an InvalidInputError (400) that names its field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise InvalidInputError(validation_message(e)) from None


def validation_message(e: ValidationError) -> str:
    """What a 400 says of a ValidationError: each wrong field (its dotted place) and why, up to five."""
    return describe_validation(e.errors())
