"""The one decoder of `data:<type>/<subtype>[;param=value]*;base64,<payload>` URLs and of bare base64, with a
size limit checked before any byte is decoded."""

from __future__ import annotations

import base64
import binascii
import re

from vlserve.core.errors import InvalidInputError, MediaTooLargeError

_DATA_URL = re.compile(r"^data:([\w.+-]+)/[\w.+-]+(?:;[\w.+-]+=[^;,]*)*;base64,", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")
NO_LIMIT = 2**62


def is_data_url(source: object) -> bool:
    return isinstance(source, str) and source[:5].lower() == "data:"


def decode_data_url(url: str, max_bytes: int = NO_LIMIT, kind: str | None = None) -> bytes:
    """The payload of a base64 data URL; `kind` ("image", "video") must match its media type when given."""
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidInputError(f"a data URL must look like 'data:{kind or '<type>'}/<subtype>;base64,<data>'")
    if kind is not None and m.group(1).lower() not in (kind, "application"):
        raise InvalidInputError(f"a {kind} data URL must have a {kind}/... media type, not {m.group(1)!r}")
    return decode_base64(url[m.end():], max_bytes)


def decode_base64(data: str, max_bytes: int = NO_LIMIT) -> bytes:
    """Tolerates whitespace, the url-safe alphabet and missing padding; rejects anything else."""
    if _WHITESPACE.search(data):
        data = _WHITESPACE.sub("", data)
    data = data.replace("-", "+").replace("_", "/")
    data += "=" * (-len(data) % 4)
    size = len(data) // 4 * 3 - (len(data) - len(data.rstrip("=")))
    if size > max_bytes:
        raise MediaTooLargeError(f"base64 media is {size} bytes, over the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"invalid base64 data: {e}") from None
