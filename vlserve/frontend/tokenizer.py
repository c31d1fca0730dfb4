"""Chat templates: --chat-template loading, rendering in the sandbox (the tokenizer: model/tokenizer_files.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from vlserve.core.errors import InvalidInputError
from vlserve.frontend import template_sandbox
from vlserve.frontend.tool_prompt import hermes_messages, template_knows_tools

logger = logging.getLogger(__name__)


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or (no such file, and it looks like Jinja) the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise InvalidInputError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template",
                            "return_dict", "return_tensors", "tools", "documents", "continue_final_message"}


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The prompt text; any failure of the template on these messages is the request's fault (400).

    Templates run in transformers' sandboxed Jinja environment; `template_kwargs` become template variables.
    A template without a tools section gets the tools, calls and results written into the messages instead.
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidInputError("this model has no chat template; send a formatted prompt instead")
    kwargs = dict(template_kwargs or {})
    clash = RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if clash:
        raise InvalidInputError(f"chat_template_kwargs may not set {sorted(clash)}")
    if template_knows_tools(template if isinstance(template, str) else None):
        if tools:
            kwargs["tools"] = tools
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = hermes_messages(messages, tools or [])
    template_sandbox.install()
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template can raise anything (TypeError, ZeroDivisionError, ...)
        raise InvalidInputError(f"the chat template failed on these messages: {type(e).__name__}: "
                                f"{str(e)[:300]}") from None
