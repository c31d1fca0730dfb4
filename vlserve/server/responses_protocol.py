"""The body of POST /v1/responses (OpenAI's Responses API), and its translation into the chat request that serves
it: one code path behind both APIs, so both take the same media, limits, constraints and tools.

vlserve keeps no responses (`store` false): a request that needs an earlier one (`previous_response_id`,
`conversation`) or asks for one to be kept (`store: true`, `background`) is refused, never half-served. Errors about
the input name its place in the request (`input[2].content[0]`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from vlserve.core.config import ServerArgs
from vlserve.core.errors import InvalidInputError
from vlserve.server.protocol import ChatCompletionRequest, validate

logger = logging.getLogger("vlserve.server")

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on `metadata`


def _set(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {}


# Fields that would change what a correct answer is, refused with what to do instead.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (_set, "vlserve keeps no responses: send the whole conversation in `input`"),
    "conversation": (_set, "vlserve keeps no conversations: send the whole conversation in `input`"),
    "store": (_set, "vlserve keeps no responses: leave `store` out or set it to false"),
    "background": (_set, "background responses need a stored response to poll: leave `background` out"),
    "include": (_set, "no extra output (logprobs, sources) can be included yet: leave `include` out"),
    "top_logprobs": (_set, "log-probabilities are served on /v1/chat/completions (`logprobs`, `top_logprobs`)"),
    "reasoning": (lambda v: _set(v) and any(x is not None for x in v.values()) if isinstance(v, dict) else _set(v),
                  "the served models do not reason in a separate channel: leave `reasoning` out"),
    "max_tool_calls": (_set, "tool calls cannot be capped yet: leave `max_tool_calls` out"),
    "prompt": (_set, "stored prompt templates are not kept: send `instructions` and `input`"),
    "truncation": (lambda v: v not in (None, "disabled"), "input is never truncated: use 'disabled'"),
    "context_management": (_set, "leave `context_management` out"),
}
# vLLM's extra sampling fields, passed on to the chat request as they are.
PASSED_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens",
                 "ignore_eos", "presence_penalty", "frequency_penalty", "skip_special_tokens",
                 "include_stop_str_in_output", "request_id", "mm_processor_kwargs", "chat_template_kwargs")
_logged_ignored: set[str] = set()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check_fields(self, server: ServerArgs) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                refuse, instead = UNSUPPORTED[name]
                if refuse(value):
                    raise InvalidInputError(f"'{name}' is not supported by this server: {instead}")
            elif name not in PASSED_EXTRAS and name not in _logged_ignored and len(_logged_ignored) < 1000:
                _logged_ignored.add(name)  # e.g. service_tier, prompt_cache_key: hints that change no answer
                logger.warning("the responses field %r is not used by vlserve and was ignored", name[:64])
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                                     for k, v in metadata.items()):
            raise InvalidInputError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                    f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidInputError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")

    def text_format(self) -> dict:
        fmt = (self.text or {}).get("format")
        return fmt if isinstance(fmt, dict) else {"type": "text"}

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request that computes this response (on a worker thread: it walks the whole input)."""
        extras = {k: v for k, v in (self.model_extra or {}).items() if k in PASSED_EXTRAS}
        fields: dict[str, Any] = dict(
            model=self.model, messages=self.messages(), max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            parallel_tool_calls=self.parallel_tool_calls, **extras)
        if self.tools:
            fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text_format())
        if response_format is not None:
            fields["response_format"] = response_format
        # The passed-on fields are checked here, as the chat request's: a wrong one is a 400 that names it.
        body = validate(ChatCompletionRequest, fields)
        body.set_format_field("text.format")
        return body

    def messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            where = f"input[{i}]"
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = {"id": _text(item, "call_id", where), "type": "function",
                        "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
                previous = messages[-1] if messages else None
                if previous is not None and previous["role"] == "assistant" and "tool_calls" in previous:
                    previous["tool_calls"].append(call)  # a turn's calls, one item each, are one assistant message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                                 "content": _call_output(item.get("output"), where)})
            else:
                raise InvalidInputError(f"{where}: items of type {kind!r} are not supported; send messages, "
                                        "function_call and function_call_output items")
        return messages


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidInputError(f"{where}.{key} must be a string")
    return value


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidInputError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidInputError(f"{where}.content must be a string or a list of content parts")
    return {"role": role, "content": [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}


def _part(part: Any, where: str) -> dict:
    """A Responses content part as the chat part it stands for."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _text(part, "text", where)}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise InvalidInputError(f"{where}.file_id: vlserve keeps no uploaded files; send the picture as "
                                    "image_url (an http(s) URL or a data URL)")
        if part.get("detail") == "low":
            raise InvalidInputError(f"{where}.detail 'low' is not supported (pictures are read at the resolution "
                                    "the model's processor picks); use 'auto', or cap it with mm_processor_kwargs "
                                    "max_pixels")
        return {"type": "image_url", "image_url": {"url": _text(part, "image_url", where)}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    if kind == "input_file":
        raise InvalidInputError(f"{where}: input_file is not supported (the served models read no documents); "
                                "send pictures as input_image and sound as input_audio")
    raise InvalidInputError(f"{where}: content parts of type {kind!r} are not supported; use input_text, "
                            "input_image or input_audio")


def _call_output(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
        return "".join(_text(p, "text", f"{where}.output") for p in output)
    raise InvalidInputError(f"{where}.output must be a string or a list of input_text parts")


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise InvalidInputError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; only "
                                "'function' tools (your code runs them)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidInputError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")


def _response_format(fmt: dict) -> dict | None:
    """`text.format` as chat's response_format."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidInputError("text.format.schema must be a JSON schema object")
        spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidInputError(f"text.format type {kind!r} is not supported; use 'text', 'json_object' or "
                            "'json_schema'")
