"""The files of `vlserve run-batch`: the input read one line at a time within a byte limit, each line checked
into a request for an endpoint or a line error; the output lines in OpenAI's batch output format; and what an
earlier run's output already holds, so that a run resumes where it stopped.

Resuming: an answered line is known by its custom_id; a line refused before any endpoint (bad JSON, say) may have
none, so its error carries the input line number (`line`, as in OpenAI's batch errors) and is known by that. Both
assume the same input file as the run that wrote the output."""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec

from vlserve.core.errors import ConfigurationError
from vlserve.server.serving import escape_line_separators

logger = logging.getLogger("vlserve.batch")

BATCH_URLS = ("/v1/chat/completions", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 1024
_SKIP_CHUNK_BYTES = 1 << 20
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a JSON object's values left unparsed (a body: as sent)
_encode = msgspec.json.Encoder().encode


@dataclass
class BatchRequest:
    """A line that goes to an endpoint: its body is the line's bytes, untouched, so the server judges them."""

    line: int
    custom_id: str
    url: str
    body: bytes


@dataclass
class LineError:
    """A line refused before any endpoint; custom_id when the line had a valid one."""

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None


def id_digest(custom_id: str) -> bytes:
    """What is remembered of a custom_id: 16 bytes whatever its length, so a set of them stays small."""
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


class InputLines:
    """The input's lines one at a time, never more: each a BatchRequest, a LineError, or None for a blank line.
    Lines are numbered from 1, blank ones included (as an editor numbers them). One reader at a time."""

    def __init__(self, stream: BinaryIO, max_line_bytes: int):
        self.stream = stream
        self.max_line_bytes = max_line_bytes
        self.line = 0
        self.seen: set[bytes] = set()  # custom_ids of the lines so far (digests), to refuse duplicates

    def __iter__(self):
        return self

    def __next__(self) -> BatchRequest | LineError | None:
        raw = self.stream.readline(self.max_line_bytes + 1)
        if not raw:
            raise StopIteration
        self.line += 1
        if len(raw) > self.max_line_bytes and not raw.endswith(b"\n"):
            self._skip_rest_of_line()
            return LineError(self.line, None, "line_too_long", f"line {self.line} is longer than "
                             f"{self.max_line_bytes} bytes (--max-batch-line-bytes)")
        text = raw.strip()
        return self.check(text) if text else None

    def _skip_rest_of_line(self) -> None:
        while (chunk := self.stream.readline(_SKIP_CHUNK_BYTES)) and not chunk.endswith(b"\n"):
            pass

    def check(self, text: bytes) -> BatchRequest | LineError:
        n = self.line
        try:
            fields = _fields.decode(text)
        except msgspec.ValidationError:
            return LineError(n, None, "invalid_line", f"line {n} is JSON but not an object")
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            return LineError(n, None, "invalid_json_line", f"line {n} is not valid JSON ({e})")
        custom_id = _value(fields.get("custom_id"))
        if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            return LineError(n, None, "invalid_custom_id", f"line {n}: custom_id must be a string of 1 to "
                             f"{MAX_CUSTOM_ID_CHARS} characters, got {_short(custom_id)}", "custom_id")
        digest = id_digest(custom_id)
        if digest in self.seen:
            return LineError(n, custom_id, "duplicate_custom_id", f"line {n}: custom_id {_short(custom_id)} is "
                             "already used by an earlier line; each line needs its own", "custom_id")
        self.seen.add(digest)
        return self._request(n, custom_id, fields)

    @staticmethod
    def _request(n: int, custom_id: str, fields: dict) -> BatchRequest | LineError:
        method, url, body = _value(fields.get("method")), _value(fields.get("url")), fields.get("body")
        if method != "POST":
            return LineError(n, custom_id, "invalid_method", f'line {n}: method must be "POST", got '
                             f"{_short(method)}", "method")
        if url not in BATCH_URLS:
            return LineError(n, custom_id, "invalid_url", f"line {n}: url must be one of {', '.join(BATCH_URLS)}; "
                             f"got {_short(url)}", "url")
        body_bytes = bytes(body) if body is not None else b"null"
        if body_bytes == b"null":
            return LineError(n, custom_id, "missing_body", f"line {n} has no body (the request to {url})", "body")
        if _streams(body):
            return LineError(n, custom_id, "stream_not_supported", f"line {n}: body.stream is true, but a batch "
                             "answers each request whole: leave stream out", "body.stream")
        return BatchRequest(n, custom_id, url, body_bytes)


class _Unreadable:
    """A value whose strings are not valid UTF-8 (JSON's syntax does not check that): invalid wherever it is."""

    def __repr__(self) -> str:
        return "a value that is not valid UTF-8"


def _value(raw: msgspec.Raw | None):
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return _Unreadable()


def _streams(body: msgspec.Raw) -> bool:
    try:
        fields = _fields.decode(body)
    except msgspec.ValidationError:
        return False  # not an object: the endpoint says so, with its own status
    return _value(fields.get("stream")) is True


# ---- output lines ----------------------------------------------------------------------------------------------
def _line(record: dict) -> bytes:
    return escape_line_separators(_encode(record)) + b"\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_line(custom_id: str, status: int, content: bytes) -> bytes:
    """An endpoint's answer, refusals (4xx, 5xx) included, as OpenAI writes them: `response` with the status."""
    try:
        body = msgspec.json.decode(content)
    except (msgspec.DecodeError, UnicodeDecodeError):  # not JSON: never from our endpoints, kept readable anyway
        body = {"error": {"message": content[:1000].decode(errors="replace"), "type": "InternalServerError",
                          "param": None, "code": status}}
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return _line({"id": _new_id("batch_req"), "custom_id": custom_id,
                  "response": {"status_code": status, "request_id": request_id or _new_id("req"), "body": body},
                  "error": None})


def error_line(error: LineError) -> bytes:
    return _line({"id": _new_id("batch_req"), "custom_id": error.custom_id, "response": None,
                  "error": {"code": error.code, "message": error.message, "param": error.param,
                            "line": error.line}})


# ---- resuming --------------------------------------------------------------------------------------------------
@dataclass
class Done:
    """What an earlier run's output holds: the custom_ids answered (digests) and the input lines refused."""

    ids: set[bytes] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)
    needs_newline: bool = False  # its last line is whole but lacks "\n": written before anything is appended

    def __len__(self) -> int:
        return len(self.ids) + len(self.lines)

    def has(self, item: BatchRequest | LineError) -> bool:
        if item.line in self.lines:
            return True
        return isinstance(item, BatchRequest) and id_digest(item.custom_id) in self.ids

    def remember(self, record) -> bool:
        """Notes a result line; False if it is not one."""
        if not isinstance(record, dict) or "custom_id" not in record:
            return False
        response, error, custom_id = record.get("response"), record.get("error"), record.get("custom_id")
        if response is None and isinstance(error, dict) and type(error.get("line")) is int:
            self.lines.add(error["line"])
        elif isinstance(response, dict) and isinstance(custom_id, str):
            self.ids.add(id_digest(custom_id))
        else:
            return False
        return True


def read_done(path: str, opened: BinaryIO | None = None) -> Done:
    """The results already in `path` (nothing if it does not exist), read from `opened` when given (the file,
    open to read and write, at its start). A last line cut short (a run killed while writing it, recognised by
    how our lines start) is cut off the file; any other line that is not a result line stops the run: the file
    is not the output of a run-batch, and appending to it would mix the two."""
    done = Done()
    try:
        f = opened or open(path, "rb")
    except FileNotFoundError:
        return done
    except OSError as e:
        raise ConfigurationError(f"cannot read the output file {path} (to resume from it): {e.strerror}") from None
    whole_bytes, cut = 0, False
    with f:
        for n, raw in enumerate(f, 1):
            if raw.strip() and not done.remember(_decode_or_none(raw)):
                if raw.endswith(b"\n") or not raw.startswith(_RESULT_START):
                    raise ConfigurationError(f"line {n} of {path} is not a run-batch result line, so this file "
                                             "is not the output of an earlier run of this input: give -o a new "
                                             "file")
                cut = True
                break
            whole_bytes += len(raw)
            done.needs_newline = not raw.endswith(b"\n")
        if cut:
            logger.warning("the last line of %s was cut short (a run stopped while writing it): dropped, its "
                           "request runs again", path)
            if opened is not None:
                os.ftruncate(opened.fileno(), whole_bytes)
            else:
                os.truncate(path, whole_bytes)
    return done


_RESULT_START = b'{"id":"batch_req_'  # how every line this module writes starts: a cut one too


def _decode_or_none(raw: bytes):
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def count_lines(path: str) -> int | None:
    """Lines in a regular file (for the progress bar); None for a pipe or stdin, which can be read only once."""
    if path == "-" or not os.path.isfile(path):
        return None
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_SKIP_CHUNK_BYTES):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")
