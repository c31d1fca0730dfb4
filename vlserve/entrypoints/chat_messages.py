"""OpenAI-format chat messages -> messages the chat template understands + the media they reference."""

from __future__ import annotations

from typing import Any

from vlserve.errors import InvalidInputError

ROLES = {"system", "user", "assistant", "tool", "developer"}


def _image_source(part: dict) -> Any:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidInputError("an image_url part needs an 'image_url': {'url': ...}")
    return url  # load_image reads data: URLs and file:// paths; the server fetches the rest first


def parse_chat_messages(messages: list[dict], allow_python_objects: bool = True,
                        ) -> tuple[list[dict], list[Any], list[str | None]]:
    """Returns template-ready messages (image parts as {"type": "image"}), the image sources in order, and
    each image's optional user-given `uuid` (stands in for the content hash).

    The offline API resolves sources itself (data URLs, local paths, PIL images). The HTTP server passes
    `allow_python_objects=False`: only `image_url` parts, whose URLs it fetches under its media policy.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list")
    rendered, images, uuids = [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise InvalidInputError(f"messages[{i}] needs a 'role' among {sorted(ROLES)}")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            rendered.append({"role": msg["role"], "content": content or ""})
            continue
        if not isinstance(content, list):
            raise InvalidInputError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                images.append(_image_source(part))
                uuids.append(part.get("uuid"))
                parts.append({"type": "image"})
            elif kind in ("image_pil", "image") and allow_python_objects:
                src = part.get("image_pil", part.get("image"))
                if src is None:
                    raise InvalidInputError(f"messages[{i}].content[{j}]: '{kind}' part without an image")
                images.append(src)
                uuids.append(part.get("uuid"))
                parts.append({"type": "image"})
            else:
                raise InvalidInputError(f"messages[{i}].content[{j}]: unsupported content part type {kind!r}")
        rendered.append({"role": msg["role"], "content": parts})
    return rendered, images, uuids
