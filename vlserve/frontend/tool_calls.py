"""Tool calling in the hermes format of Qwen2.5 / Qwen3: tools offered, calls constrained, calls parsed.

A call is written `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. `tool_choice` "required"
or a named function turns into a grammar that admits only such calls of the offered tools, arguments valid
against each tool's JSON schema; "auto" leaves the model free and parses what it writes; "none" offers no tools.
Parsing reads the detokenized text, so it works the same for the whole answer and for a stream.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import StructuredOutputsParams

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.S)
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
        if name not in {t["function"]["name"] for t in tools}:
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
    one_call = {
        "anyOf": [{
            "type": "object",
            "properties": {"name": {"const": fn["name"]},
                           "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        } for fn in offered],
        "x-guidance": _CALL_JSON_STYLE,
    }
    repeat = ' ("\\n" call)*' if parallel and choice.mode == "required" else ""
    lark = (f"start: call{repeat}\n"
            f"call: {json.dumps(CALL_START + chr(10))} body {json.dumps(chr(10) + CALL_END)}\n"
            f"body: %json {json.dumps(one_call)}\n")
    return StructuredOutputsParams(grammar=lark)


def _call_from(body: str) -> dict | None:
    """One OpenAI tool call from the JSON between the tags, or None if it is not a call."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": arguments}}


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, the calls) from a whole answer. A block that does not parse as a
    call stays in the content."""
    calls, kept, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _call_from(m.group(1).strip())
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class ToolCallStream:
    """Splits one streamed choice into content deltas and whole tool calls as their closing tag arrives.

    Text that may be the start of `<tool_call>` is held back until it is known not to be; whitespace between
    calls is not sent as content.
    """

    def __init__(self):
        self.pos = 0  # characters of the text already turned into deltas
        self.in_call = False
        self.num_calls = 0
        self._held_space = ""

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """`text`: the choice's whole visible text so far. Returns (new content, new calls with their index)."""
        content, calls = [], []
        while True:
            rest = text[self.pos:]
            if not self.in_call:
                start = rest.find(CALL_START)
                if start < 0:
                    keep = 0 if finished else _partial_tag(rest, CALL_START)
                    content.append(rest[:len(rest) - keep])
                    self.pos += len(rest) - keep
                    break
                content.append(rest[:start])
                self.pos += start + len(CALL_START)
                self.in_call = True
                continue
            end = rest.find(CALL_END)
            if end < 0:
                if finished:  # cut off inside a call: what there is goes out as text
                    content.append(CALL_START + rest)
                    self.pos = len(text)
                break
            call = _call_from(rest[:end].strip())
            if call is None:
                content.append(CALL_START + rest[:end + len(CALL_END)])
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            self.pos += end + len(CALL_END)
            self.in_call = False
        return self._visible("".join(content), finished), calls

    def _visible(self, new: str, finished: bool) -> str:
        text = self._held_space + new
        if text.strip():
            self._held_space = ""
            return text
        self._held_space = "" if finished else text
        return text if finished and not self.num_calls else ""


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
