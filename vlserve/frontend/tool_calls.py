"""Tool calling in the hermes format of Qwen2.5 / Qwen3: tools offered, calls constrained, calls parsed.

A call is written `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. `tool_choice` "required"
or a named function turns into a grammar that admits only such calls of the offered tools, arguments valid
against each tool's JSON schema; "auto" leaves the model free and parses what it writes; "none" offers no tools.
Parsing reads the detokenized text, so it works the same for the whole answer and for a stream. A call's
"arguments" reach the client exactly as the model wrote them (its numbers, spacing and escapes untouched), and
only if they are strict JSON: a block holding NaN or Infinity is no call and stays in the content, as vLLM's
hermes parser leaves text it cannot parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from json.decoder import scanstring

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import StructuredOutputsParams

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# The layout the models were trained on: ", " and ": " between items, no other free whitespace.
_CALL_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None


def check_tools(tools: list | None) -> list[dict]:
    """The `tools` field, checked: function tools with a name and (optional) JSON-schema parameters."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidInputError("tools must be a list")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidInputError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidInputError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise InvalidInputError(f"tools: the function name {name!r} is offered twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidInputError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice, tools: list[dict]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise InvalidInputError(f"tool_choice names the function {name!r}, which is not among the tools")
        return ToolChoice("named", name)
    else:
        raise InvalidInputError("tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}")
    if mode != "none" and not tools:
        raise InvalidInputError(f"tool_choice {mode!r} needs tools")
    return ToolChoice(mode)


def call_grammar(tools: list[dict], choice: ToolChoice, parallel: bool) -> StructuredOutputsParams | None:
    """For "required" / a named function: a grammar admitting only valid calls (several when `parallel`)."""
    if choice.mode not in ("required", "named"):
        return None
    offered = [t["function"] for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    rules = [f"body{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(offered)]
    repeat = ' ("\\n" call)*' if parallel and choice.mode == "required" else ""
    lark = "\n".join([f"start: call{repeat}",
                      f"call: {json.dumps(CALL_START + chr(10))} body {json.dumps(chr(10) + CALL_END)}",
                      "body: " + " | ".join(f"body{i}" for i in range(len(offered))), *rules])
    return StructuredOutputsParams(grammar=lark)


def _call_schema(fn: dict) -> dict:
    """The JSON of one call of `fn`. The tool's own definitions move to the root, where its "#/$defs/..."
    references (pydantic writes them) resolve."""
    params = dict(fn.get("parameters") or {"type": "object"})
    schema = {"type": "object",
              "properties": {"name": {"const": fn["name"]}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _CALL_JSON_STYLE}
    for key in ("$defs", "definitions"):
        if key in params:
            schema[key] = params.pop(key)
    return schema


def _call_from(data, text: str, at: int) -> dict | None:
    """One OpenAI tool call from the JSON `data` read at text[at:], or None if it is not a call.

    The arguments are the model's own text of the "arguments" value (its numbers, spacing and escapes kept),
    or, when the model wrote them as a JSON string, that string's content, which must then be strict JSON too.
    """
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    key = "arguments" if "arguments" in data else "parameters" if "parameters" in data else None
    if key is None:
        arguments = "{}"
    elif isinstance(data[key], str):
        arguments = data[key]
        try:
            _STRICT.decode(arguments)
        except (ValueError, RecursionError):
            return None
    else:
        start, end = _member_spans(text, at)[key]  # the model's own text of the value
        arguments = text[start:end]
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": arguments}}


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


class _Number:
    """A number the parser saw. Its value is never needed (arguments are passed on as text), so it is never
    converted: no float rounding, no limit on an integer's digits."""


_NUMBER = _Number()
# Strict JSON: Python's json takes NaN, Infinity and -Infinity, which no other JSON reader does.
_STRICT = json.JSONDecoder(parse_constant=_not_json, parse_int=lambda _: _NUMBER, parse_float=lambda _: _NUMBER)
_JSON_SPACE = " \t\n\r"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_SPACE:
        i += 1
    return i


def _member_spans(text: str, at: int) -> dict[str, tuple[int, int]]:
    """key -> (start, end) of its value's text, for the JSON object at text[at:] (already known to parse).
    A repeated key keeps its last value, as the parsed object does."""
    spans: dict[str, tuple[int, int]] = {}
    i = _skip_space(text, at + 1)  # past "{"
    while text[i] == '"':
        key, i = scanstring(text, i + 1)
        start = _skip_space(text, _skip_space(text, i) + 1)  # past ":"
        _, end = _STRICT.raw_decode(text, start)
        spans[key] = (start, end)
        i = _skip_space(text, end)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
    return spans


def _scan_call(text: str, start: int, finished: bool) -> tuple[str, dict | None, int]:
    """Reads a call whose opening tag ends at `start`: ("call", call, end), ("text", None, end) when it is no
    call (end: past its closing tag, or the end of the text), or ("wait", None, 0) while it may still become one.

    The JSON is read by its own extent, so a string argument holding "</tool_call>" does not cut the call.
    """
    body = len(text) - len(text[start:].lstrip())
    try:
        data, json_end = _STRICT.raw_decode(text, body)
    except (ValueError, RecursionError):  # incomplete, or not strict JSON: only the answer's end tells which
        if not finished:
            return "wait", None, 0
        close = text.find(CALL_END, start)
        return "text", None, len(text) if close < 0 else close + len(CALL_END)
    after = text[json_end:].lstrip()
    close_at = len(text) - len(after)
    if after.startswith(CALL_END):
        call = _call_from(data, text, body)
        return ("call" if call else "text"), call, close_at + len(CALL_END)
    if not finished and CALL_END.startswith(after):
        return "wait", None, 0
    close = text.find(CALL_END, json_end)
    return "text", None, len(text) if close < 0 else close + len(CALL_END)


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, the calls) from a whole answer: exactly what a stream of it gives.
    A block that does not parse as a call stays in the content."""
    content, calls = ToolCallStream().feed(text, finished=True)
    if not calls:
        return text, []
    return (content or None), [{k: v for k, v in c.items() if k != "index"} for c in calls]


class ToolCallStream:
    """Splits one streamed choice into content deltas and whole tool calls as each call's closing tag arrives.

    Text that may be the start of `<tool_call>` is held back until it is known not to be; whitespace next to
    a call is not content (trailing whitespace waits until text follows it).
    """

    def __init__(self):
        self.pos = 0  # characters of the text already turned into deltas
        self.in_call = False
        self.num_calls = 0
        self._held_space = ""
        self._after_call = False

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """`text`: the choice's whole visible text so far. Returns (new content, new calls with their index)."""
        content: list[str] = []
        calls: list[dict] = []
        while True:
            rest = text[self.pos:]
            if not self.in_call:
                start = rest.find(CALL_START)
                if start < 0:
                    keep = 0 if finished else _partial_tag(rest, CALL_START)
                    self._content(rest[:len(rest) - keep], content)
                    self.pos += len(rest) - keep
                    break
                self._content(rest[:start], content)
                self.pos += start + len(CALL_START)
                self.in_call = True
                continue
            kind, call, end = _scan_call(text, self.pos, finished)
            if kind == "wait":
                break
            if kind == "call":
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
                self._held_space, self._after_call = "", True
            else:
                self._content(CALL_START + text[self.pos:end], content)
            self.pos, self.in_call = end, False
        if finished and not self._after_call:
            content.append(self._held_space)
            self._held_space = ""
        return "".join(content), calls

    def _content(self, piece: str, out: list[str]) -> None:
        if self._after_call:
            piece = piece.lstrip()
            self._after_call = not piece
        body = piece.rstrip()
        if body:
            out.append(self._held_space + body)
            self._held_space = piece[len(body):]
        else:
            self._held_space += piece


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
