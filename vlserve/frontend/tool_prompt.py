"""Tools and tool turns for chat templates that have no tools section (Qwen2-VL's and Qwen2.5-VL's own).

Such a template gets plain messages: the offered tools go into the system message in the hermes layout the
Qwen models were trained on (`<tools>` signatures, `<tool_call>` answers), earlier calls become text of their
assistant turn, and tool results become a user turn of `<tool_response>` blocks, pictures inside kept in
place. Templates that do know tools (Qwen3-VL's) get the tools and messages as they are.
"""

from __future__ import annotations

import json

from vlserve.frontend.tool_calls import CALL_END, CALL_START

DEFAULT_SYSTEM = "You are a helpful assistant."


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tools_system_text(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("\n\n# Tools\n\n"
            "You can call functions to help with the user's request.\n\n"
            f"The available functions are described inside <tools></tools> tags:\n<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            f"{CALL_START}{CALL_END} tags, one call per block:\n"
            f'{CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_END}')


def _call_text(call: dict) -> str:
    fn = call.get("function", {})
    body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def _as_parts(content) -> list[dict]:
    if content is None or content == "":
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _joined(parts: list[dict]) -> list[dict] | str:
    """Adjacent text parts merged; plain text when no media is left among them."""
    out: list[dict] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
        else:
            out.append(part)
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Template-ready messages with the tools, calls and results written out as text."""
    out: list[dict] = []
    for msg in messages:
        role = msg["role"]
        if role == "assistant" and msg.get("tool_calls"):
            parts = _as_parts(msg.get("content"))
            calls = "\n".join(_call_text(c) for c in msg["tool_calls"])
            parts.append({"type": "text", "text": ("\n" if parts else "") + calls})
            out.append({"role": "assistant", "content": _joined(parts)})
        elif role == "tool":
            block = [{"type": "text", "text": "<tool_response>\n"}, *_as_parts(msg.get("content")),
                     {"type": "text", "text": "\n</tool_response>"}]
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["_parts"] += [{"type": "text", "text": "\n"}, *block]
            else:
                out.append({"role": "user", "_tool_results": True, "_parts": block})
        else:
            out.append({k: v for k, v in msg.items() if k in ("role", "content")})
    for msg in out:
        if msg.pop("_tool_results", False):
            msg["content"] = _joined(msg.pop("_parts"))
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": _joined(_as_parts(out[0]["content"]) +
                                                           [{"type": "text", "text": tools_system_text(tools)}])}
        else:
            out.insert(0, {"role": "system", "content": DEFAULT_SYSTEM + tools_system_text(tools)})
    return out
