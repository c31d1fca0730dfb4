"""The one decoder of `data:<type>/<subtype>[;param=value]*;base64,<payload>` URLs and of bare base64, with a
size limit checked before any byte is decoded.

A payload can be tens of megabytes. Every step that reads it (ASCII check, whitespace and url-safe alphabet,
padding, decoding) works on slices of at most `CHUNK` characters, so no single C call holds the GIL for long:
decoding runs on a worker thread, but a worker that held the GIL for a whole 60 MB payload (a regex pass over it
took over a second) would still have stalled the event loop, and with it /health, for that long."""

from __future__ import annotations

import binascii
import re

from vlserve.core.errors import InvalidInputError, MediaTooLargeError

# Only the header is matched (a hostile "header" of megabytes without a comma is refused, not scanned).
MAX_HEADER_CHARS = 1024
_DATA_URL = re.compile(r"data:([\w.+-]+)/[\w.+-]+(?:;[\w.+-]+=[^;,]*)*;base64,", re.IGNORECASE)
NO_LIMIT = 2**62
CHUNK = 1 << 20  # characters one C call handles at most (a multiple of 4): ~1-5 ms with the GIL held
_WHITESPACE = b" \t\n\r\x0b\x0c"
_URL_SAFE = bytes.maketrans(b"-_", b"+/")


def is_data_url(source: object) -> bool:
    return isinstance(source, str) and source[:5].lower() == "data:"


def decode_data_url(url: str, max_bytes: int = NO_LIMIT, kind: str | None = None,
                    limit_flag: str | None = None) -> bytes:
    """The payload of a base64 data URL; `kind` ("image", "video") must match its media type when given.
    `limit_flag`: the option that sets `max_bytes` (e.g. "--max-media-bytes"), named when the payload is over it."""
    m = _DATA_URL.match(url, 0, MAX_HEADER_CHARS)
    if m is None:
        comma = url.find(",", 0, MAX_HEADER_CHARS + 1)
        if comma < 0 and url[:5].lower() == "data:" and len(url) > MAX_HEADER_CHARS:
            raise InvalidInputError(f"a data URL's header (what comes before the comma) must be at most "
                                    f"{MAX_HEADER_CHARS} characters")
        raise InvalidInputError(f"a data URL must look like 'data:{kind or '<type>'}/<subtype>;base64,<data>'")
    if kind is not None and m.group(1).lower() not in (kind, "application"):
        raise InvalidInputError(f"a {kind} data URL must have a {kind}/... media type, not {m.group(1)!r}")
    return decode_base64(url, max_bytes, start=m.end(), limit_flag=limit_flag)


def encode_data_url(data: bytes | bytearray | memoryview, media_type: str) -> str:
    """`data:<media_type>;base64,<data>`, encoded `CHUNK` characters at a time: the only copies are the encoded
    bytes and the string made of them."""
    encoded = bytearray(f"data:{media_type};base64,".encode("ascii"))
    view, step = memoryview(data).cast("B"), CHUNK // 4 * 3
    for i in range(0, len(view), step):
        encoded += binascii.b2a_base64(view[i:i + step], newline=False)
    return encoded.decode("ascii")


def decode_base64(data: str, max_bytes: int = NO_LIMIT, start: int = 0, limit_flag: str | None = None) -> bytes:
    """`data[start:]` decoded. Tolerates ASCII whitespace, the url-safe alphabet and missing padding; rejects
    anything else (padding only at the end)."""
    clean = bytearray()
    for i in range(start, len(data), CHUNK):
        try:
            piece = data[i:i + CHUNK].encode("ascii")
        except UnicodeEncodeError:
            raise InvalidInputError("invalid base64 data: it holds a non-ASCII character") from None
        clean += piece.translate(_URL_SAFE, _WHITESPACE)
    pad = clean.find(b"=")
    if pad >= 0 and clean.count(b"=", pad) != len(clean) - pad:
        raise InvalidInputError("invalid base64 data: padding ('=') before its end")
    clean += b"=" * (-len(clean) % 4)
    if pad < 0:
        pad = clean.find(b"=", max(0, len(clean) - 3))
    size = len(clean) // 4 * 3 - (len(clean) - pad if pad >= 0 else 0)
    if size > max_bytes:
        raise MediaTooLargeError(f"base64 media is {size} bytes, over the limit of {max_bytes} bytes"
                                 + (f" ({limit_flag})" if limit_flag else ""))
    out = bytearray()
    view = memoryview(clean)
    try:
        for i in range(0, len(clean), CHUNK):
            out += binascii.a2b_base64(view[i:i + CHUNK], strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"invalid base64 data: {e}") from None
    finally:
        view.release()
    return bytes(out)
