"""OpenAI-format chat messages -> messages the chat template understands + the media they reference."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vlserve.core.errors import InvalidInputError
from vlserve.media.audio_formats import SNIFF_BYTES, check_audio_format
from vlserve.media.data_url import MAX_HEADER_CHARS, decode_base64, is_data_url

ROLES = {"system", "user", "assistant", "tool", "developer"}
MEDIA_KINDS = ("image", "video", "audio")


@dataclass
class ParsedChat:
    messages: list[dict]  # template-ready: media parts become {"type": "image"} / {"type": "video"} / {"type": "audio"}
    media: dict[str, list] = field(default_factory=lambda: {kind: [] for kind in MEDIA_KINDS})
    uuids: dict[str, list] = field(default_factory=lambda: {kind: [] for kind in MEDIA_KINDS})
    num_text_chars: int = 0  # all text of all messages: bounds the work before the template is rendered

    def prompt(self, text: str) -> dict:
        """The engine prompt for the rendered `text`, with this chat's media and uuids."""
        prompt: dict = {"prompt": text}
        data = {kind: items for kind, items in self.media.items() if items}
        if data:
            prompt["multi_modal_data"] = data
            ids = {kind: self.uuids[kind] for kind in data if any(self.uuids[kind])}
            if ids:
                prompt["multi_modal_uuids"] = ids
        return prompt


def _url(part: dict, key: str) -> str:
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidInputError(f"a {key} part needs a '{key}': {{'url': ...}}")
    return url  # data: and file:// are read where the media is loaded; the server fetches http(s) first


def _input_audio(part: dict, where: str) -> str:
    """OpenAI's `input_audio` part, {"input_audio": {"data": <base64>, "format": "wav" | "mp3" | ...}}, as a data
    URL (fetched, that is size-checked and decoded, like any other). The format is checked against the bytes here,
    from their first few (the rest is decoded off the event loop)."""
    value = part.get("input_audio")
    data = value.get("data") if isinstance(value, dict) else None
    fmt = value.get("format") if isinstance(value, dict) else None
    if not isinstance(data, str) or not data:
        raise InvalidInputError(f"{where}: an input_audio part needs 'input_audio': {{'data': <base64>, "
                                "'format': ...}")
    if not isinstance(fmt, str):
        raise InvalidInputError(f"{where}: input_audio needs a 'format' string (wav, mp3, flac, ogg, ...)")
    start = 0
    if is_data_url(data):  # its payload: the header is refused where the URL is decoded if it has no ";base64,"
        start = data.find(";base64,", 0, MAX_HEADER_CHARS)
        start = len(data) if start < 0 else start + len(";base64,")
    lead = "".join(data[start:start + 256].split())[:-(-SNIFF_BYTES // 3) * 4]  # the base64 of the first SNIFF_BYTES
    check_audio_format(fmt, decode_base64(lead), f"{where}.input_audio")
    return data if is_data_url(data) else f"data:audio/{fmt.lower()};base64,{data}"


_TEXT_SLICE = 1 << 20  # characters checked at a time (no whole copy of a long text)


def _text(text: str, where: str) -> str:
    try:
        for i in range(0, len(text), _TEXT_SLICE):
            text[i:i + _TEXT_SLICE].encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(f"{where}: the text is not valid unicode (a lone surrogate)") from None
    return text


def _embeds(part: dict) -> dict:
    """`image_embeds` part: {"image_embeds": <b64 safetensors | tensor>, "image_grid_thw": [t, h, w]}, or the
    same two keys nested inside "image_embeds"."""
    value = part.get("image_embeds")
    if isinstance(value, dict):
        value, grid = value.get("image_embeds"), value.get("image_grid_thw")
    else:
        grid = part.get("image_grid_thw")
    if value is None:
        raise InvalidInputError("an image_embeds part needs its 'image_embeds' (base64 of a safetensors file)")
    return {"image_embeds": value, "image_grid_thw": grid}


def parse_chat_messages(messages: list[dict], allow_python_objects: bool = True,
                        modalities: tuple[str, ...] | None = None) -> ParsedChat:
    """Splits OpenAI messages into template-ready messages and their media, in order of appearance.

    The offline API also takes `image` / `image_pil` / `video` / `audio` parts holding Python objects (PIL
    images, paths, frame arrays, `(waveform, sample_rate)` tuples). The HTTP server passes
    `allow_python_objects=False`: only URL, `input_audio` and embedding parts. `modalities`: the media kinds the
    model takes (a part of another kind is refused, naming them); None takes every kind.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list")
    chat = ParsedChat([])
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise InvalidInputError(f"messages[{i}] needs a 'role' among {sorted(ROLES)}")
        extra = _tool_fields(msg, i)
        content = msg.get("content")
        if content is None or isinstance(content, str):
            chat.messages.append({"role": msg["role"], "content": _text(content or "", f"messages[{i}].content"),
                                  **extra})
            chat.num_text_chars += len(content or "")
            continue
        if not isinstance(content, list):
            raise InvalidInputError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidInputError(f"{where}: a text part needs a 'text' string")
                parts.append({"type": "text", "text": _text(part["text"], where)})
                chat.num_text_chars += len(part["text"])
                continue
            if kind == "image_url":
                media_kind, source = "image", _url(part, "image_url")
            elif kind == "video_url":
                media_kind, source = "video", _url(part, "video_url")
            elif kind == "audio_url":
                media_kind, source = "audio", _url(part, "audio_url")
            elif kind == "input_audio":
                media_kind, source = "audio", _input_audio(part, where)
            elif kind == "image_embeds":
                media_kind, source = "image", _embeds(part)
            elif kind in ("image_pil", "image", "video", "audio") and allow_python_objects:
                media_kind, source = ("image" if kind == "image_pil" else kind), part.get(kind)
                if source is None:
                    raise InvalidInputError(f"{where}: '{kind}' part without its object")
            else:
                raise InvalidInputError(f"{where}: unsupported content part type {kind!r}")
            if modalities is not None and media_kind not in modalities:
                takes = " and ".join(modalities) if modalities else "text only"
                raise InvalidInputError(f"{where}: this model takes {takes}, not {media_kind} (a '{kind}' part)")
            uuid = part.get("uuid")
            if uuid is not None and not isinstance(uuid, str):
                raise InvalidInputError(f"{where}: uuid must be a string")
            chat.media[media_kind].append(source)
            chat.uuids[media_kind].append(uuid)
            parts.append({"type": media_kind})
        chat.messages.append({"role": msg["role"], "content": parts, **extra})
    return chat


def _tool_fields(msg: dict, i: int) -> dict:
    """An assistant turn's earlier `tool_calls` (arguments as objects, as templates expect) and a tool turn's
    `tool_call_id` / `name`."""
    extra = {}
    for key in ("tool_call_id", "name"):
        if msg.get(key) is not None:
            if not isinstance(msg[key], str):
                raise InvalidInputError(f"messages[{i}].{key} must be a string")
            extra[key] = msg[key]
    calls = msg.get("tool_calls")
    if calls is None:
        return extra
    if msg["role"] != "assistant" or not isinstance(calls, list):
        raise InvalidInputError(f"messages[{i}].tool_calls must be a list, on an assistant message")
    checked = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidInputError(f"messages[{i}].tool_calls[{j}] needs a 'function' with a 'name'")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise InvalidInputError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise InvalidInputError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
        checked.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    extra["tool_calls"] = checked
    return extra
