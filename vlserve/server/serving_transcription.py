"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text API, for models that hear.

The uploaded clip becomes the chat request a client could send itself (one user message: the clip and an
instruction) and runs through the chat handler, so it gets every bound a chat `input_audio` part gets (format
sniffing, --max-media-bytes, --max-audio-seconds, sample rate and channels) and the same metrics. The multipart
body is read within --max-request-bytes and parsed here, from those bytes, on a worker thread: nothing is spooled
to disk and nothing that grows with the upload runs on the event loop. The clip is never copied: it is decoded
once, from the body, with the model processor's bounds, and its samples are the prompt's audio (and its length the
answer's duration); only where an encoder elsewhere decodes the media (disaggregated serving) is it sent as a data
URL.

The clip is transcribed as one block: verbose_json has one segment spanning it, srt and vtt one cue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.frontend.prepared_prompt import PreparedPrompt
from vlserve.frontend.prompt_encoder import LocalPromptEncoder
from vlserve.media.audio import AudioLimits, load_audio
from vlserve.media.audio_formats import DEMUXERS, FORMATS, SNIFF_BYTES, sniff_audio_format
from vlserve.media.data_url import encode_data_url
from vlserve.server.protocol import ChatCompletionRequest, validate
from vlserve.server.serving import read_body_buffer
from vlserve.server.serving_chat import OpenAIServingChat

logger = logging.getLogger("vlserve.server")

TRANSCRIBE, TRANSLATE = "transcribe", "translate"
# What the model is asked: Qwen2-Audio-Instruct and the Qwen2.5-Omni thinker transcribe and translate speech when
# asked to in a chat. Every instruction is written here and nowhere else.
INSTRUCTIONS = {
    TRANSCRIBE: "Transcribe the speech in this audio. Reply with the transcript only.",
    TRANSLATE: "Translate the speech in this audio into English. Reply with the English translation only.",
}
LANGUAGE_HINT = "The speech is in {language}."
CONTEXT_HINT = "Context: {prompt}"

# The output bound when the request names none (a transcript is short; a model that never stops must not run to
# the end of its context). 2048 tokens hold about 25 minutes of speech; `max_completion_tokens` changes it.
DEFAULT_MAX_TOKENS = 2048
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MAX_FORM_PARTS = 64  # OpenAI's form has about a dozen fields; a body of many tiny parts is refused, not parsed

# Sampling fields a form may carry (vLLM's transcription API takes these too), as the chat request's types.
_NUMBER_FIELDS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "presence_penalty": float,
    "frequency_penalty": float, "repetition_penalty": float, "max_completion_tokens": int,
}
_TEXT_FIELDS = ("model", "language", "prompt", "response_format")
# ASCII digits only: `\d` takes any script's (and int() and float() then read "١٢" as 12)
_INTEGER, _DECIMAL = r"[+-]?[0-9]{1,19}", r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
# OpenAI fields that would change the answer and that this server cannot honour: refused, never ignored.
# base name (a list field is sent as `name[]`) -> (refused when its values are, why)
_REFUSED: dict[str, tuple[Callable[[list[str]], bool], str]] = {
    "timestamp_granularities": (lambda v: any(x != "segment" for x in v),
                                "word timestamps are not produced (one segment spans the clip)"),
    "stream": (lambda v: any(x.lower() != "false" for x in v), "transcripts are not streamed; send stream=false"),
    "include": (lambda v: any(v), "token logprobs of a transcript are not returned"),
    "chunking_strategy": (lambda v: True, "the clip is always transcribed as one block"),
    "known_speaker_names": (lambda v: True, "speakers are not told apart"),
    "known_speaker_references": (lambda v: True, "speakers are not told apart"),
    "keywords": (lambda v: True, "use 'prompt' to give words the speech holds"),
    "languages": (lambda v: True, "give one 'language'"),
}
_logged_ignored: set[str] = set()

# ISO-639-1 codes of languages speech models are trained on, with the English names the instruction uses.
_LANGUAGE_TABLE = """
af Afrikaans|am Amharic|ar Arabic|as Assamese|az Azerbaijani|ba Bashkir|be Belarusian|bg Bulgarian|bn Bengali|
bo Tibetan|br Breton|bs Bosnian|ca Catalan|cs Czech|cy Welsh|da Danish|de German|el Greek|en English|es Spanish|
et Estonian|eu Basque|fa Persian|fi Finnish|fo Faroese|fr French|gl Galician|gu Gujarati|ha Hausa|he Hebrew|
hi Hindi|hr Croatian|ht Haitian Creole|hu Hungarian|hy Armenian|id Indonesian|is Icelandic|it Italian|
ja Japanese|jv Javanese|ka Georgian|kk Kazakh|km Khmer|kn Kannada|ko Korean|la Latin|lb Luxembourgish|
ln Lingala|lo Lao|lt Lithuanian|lv Latvian|mg Malagasy|mi Maori|mk Macedonian|ml Malayalam|mn Mongolian|
mr Marathi|ms Malay|mt Maltese|my Burmese|ne Nepali|nl Dutch|nn Norwegian Nynorsk|no Norwegian|oc Occitan|
pa Punjabi|pl Polish|ps Pashto|pt Portuguese|ro Romanian|ru Russian|sa Sanskrit|sd Sindhi|si Sinhala|
sk Slovak|sl Slovenian|sn Shona|so Somali|sq Albanian|sr Serbian|su Sundanese|sv Swedish|sw Swahili|
ta Tamil|te Telugu|tg Tajik|th Thai|tk Turkmen|tl Tagalog|tr Turkish|tt Tatar|uk Ukrainian|ur Urdu|
uz Uzbek|vi Vietnamese|yi Yiddish|yo Yoruba|zh Chinese"""
LANGUAGES: dict[str, str] = dict(entry.strip().split(" ", 1) for entry in _LANGUAGE_TABLE.split("|"))


def instruction(task: str, language: str | None = None, prompt: str | None = None) -> str:
    """The text part sent with the clip. `language`: an ISO-639-1 code (of `LANGUAGES`)."""
    parts = [INSTRUCTIONS[task]]
    if language:
        parts.append(LANGUAGE_HINT.format(language=LANGUAGES[language]))
    if prompt:
        parts.append(CONTEXT_HINT.format(prompt=prompt))
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# The multipart form
# ---------------------------------------------------------------------------------------------


@dataclass
class UploadForm:
    file: memoryview | bytes | None = None  # a view of the body it came in: never copied
    filename: str | None = None
    fields: dict[str, list[str]] = field(default_factory=dict)  # by name as sent (`include[]` keeps its [])


def multipart_boundary(content_type: str | None) -> bytes:
    """The boundary of a multipart/form-data body, from its Content-Type; 400 for any other body."""
    kind, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidInputError("send the request as multipart/form-data, with the audio in its 'file' field "
                                f"(got Content-Type {(content_type or 'none')[:64]!r})")
    return boundary


def parse_form(body: bytearray, boundary: bytes) -> UploadForm:
    """A multipart/form-data body already read (so bounded) -> its file and text fields, each a view of `body`
    (the file is not copied). Runs on a worker thread: its cost grows with the body."""
    parts: list[tuple[dict[bytes, bytes], list[tuple[bytes | bytearray, int, int]]]] = []
    name, value = bytearray(), bytearray()
    ended = False

    def part_begin() -> None:
        if len(parts) >= MAX_FORM_PARTS:
            raise InvalidInputError(f"the form has more than {MAX_FORM_PARTS} parts")
        parts.append(({}, []))

    def header_end() -> None:
        parts[-1][0][bytes(name).strip().lower()] = bytes(value).strip()
        name.clear()
        value.clear()

    def end() -> None:
        nonlocal ended
        ended = True

    callbacks = {
        "on_part_begin": part_begin,
        "on_header_field": lambda data, start, stop: name.extend(memoryview(data)[start:stop]),
        "on_header_value": lambda data, start, stop: value.extend(memoryview(data)[start:stop]),
        "on_header_end": header_end,
        "on_part_data": lambda data, start, stop: parts[-1][1].append((data, start, stop)),
        "on_end": end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except FormParserError as e:
        raise InvalidInputError(f"the multipart body is malformed ({e})") from None
    if not ended:
        raise InvalidInputError("the multipart body ends before its closing boundary")
    form = UploadForm()
    for headers, pieces in parts:
        _add_part(form, headers, _part_data(body, pieces))
    return form


def _part_data(body: bytearray, pieces: list[tuple[bytes | bytearray, int, int]]) -> memoryview | bytes:
    """A part's bytes from the parser's pieces: a view of `body` when they are one run of it (the whole body is
    parsed in one go, so they are); joined otherwise (a piece of the parser's own look-behind buffer)."""
    if all(data is body for data, _, _ in pieces) and all(a[2] == b[1] for a, b in zip(pieces, pieces[1:])):
        return memoryview(body)[pieces[0][1]:pieces[-1][2]] if pieces else b""
    return b"".join(memoryview(data)[start:stop] for data, start, stop in pieces)


def _add_part(form: UploadForm, headers: dict[bytes, bytes], data: memoryview | bytes) -> None:
    kind, params = parse_options_header(headers.get(b"content-disposition", b""))
    field_name = params.get(b"name")
    if kind != b"form-data" or field_name is None:
        raise InvalidInputError("every part of the form needs a 'Content-Disposition: form-data; name=...' header")
    field_name = field_name.decode("utf-8", "replace")
    if field_name == "file":
        if form.file is not None:
            raise InvalidInputError("the form holds more than one 'file': send one clip per request")
        filename = params.get(b"filename")
        form.file, form.filename = data, filename.decode("utf-8", "replace") if filename else None
        return
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(f"the form field {field_name[:64]!r} is not UTF-8 text") from None
    form.fields.setdefault(field_name, []).append(text)


# ---------------------------------------------------------------------------------------------
# The request's options
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TranscriptionOptions:
    task: str
    model: str | None
    language: str | None  # an ISO-639-1 code of LANGUAGES
    prompt: str | None
    response_format: str
    sampling: dict  # ChatCompletionRequest sampling fields, typed

    @classmethod
    def from_form(cls, fields: dict[str, list[str]], task: str) -> "TranscriptionOptions":
        _refuse_unsupported(fields)
        text = {name: _single(fields, name) for name in _TEXT_FIELDS}
        response_format = text["response_format"] or "json"
        if response_format not in RESPONSE_FORMATS:
            raise InvalidInputError(f"response_format {response_format[:32]!r} is not supported; use one of "
                                    f"{', '.join(RESPONSE_FORMATS)}")
        language = text["language"].strip().lower() if text["language"] else None
        if language is not None and language not in LANGUAGES:
            raise InvalidInputError(f"language {language[:32]!r} is not an ISO-639-1 code this server knows "
                                    "(e.g. 'en', 'zh', 'de')")
        sampling: dict = {"temperature": 0.0}  # OpenAI's default
        for name, kind in _NUMBER_FIELDS.items():
            raw = _single(fields, name)
            if raw is not None:
                sampling[name] = _number(name, raw, kind)
        return cls(task, text["model"] or None, language, text["prompt"] or None, response_format, sampling)

    def chat_request(self, audio_part: dict) -> ChatCompletionRequest:
        """The chat request for this clip (`audio_part`: a `Clip`'s), as a client would send it."""
        content = [audio_part, {"type": "text", "text": instruction(self.task, self.language, self.prompt)}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], **self.sampling}
        if self.response_format == "verbose_json":
            body.update(logprobs=True, top_logprobs=0)  # for the segment's avg_logprob
        return validate(ChatCompletionRequest, body)  # a value of the right type the chat request still refuses


def _refuse_unsupported(fields: dict[str, list[str]]) -> None:
    for name, values in fields.items():
        base = name.split("[", 1)[0]
        refused = _REFUSED.get(base)
        if refused is not None and refused[0](values):
            raise InvalidInputError(f"'{name[:64]}' is not supported by this server ({refused[1]}); remove it from "
                                    "the request")
        known = refused is not None or base in _TEXT_FIELDS or base in _NUMBER_FIELDS
        if not known and base not in _logged_ignored and len(_logged_ignored) < 1000:
            _logged_ignored.add(base)
            logger.warning("the transcription form field %r is not used by vlserve and was ignored", base[:64])


def _single(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    if values is None:
        return None
    if len(values) > 1:
        raise InvalidInputError(f"the form field '{name}' is given {len(values)} times; give it once")
    return values[0]


def _number(name: str, raw: str, kind: type) -> int | float:
    text = raw.strip()
    try:  # as JSON writes numbers: Python's own int() and float() also take "1_000" and "infinity"
        if not re.fullmatch(_INTEGER if kind is int else _DECIMAL, text):
            raise ValueError
        value = kind(text)
    except ValueError:
        raise InvalidInputError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                                f"got {raw[:32]!r}") from None
    if not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a finite number, got {raw[:32]!r}")
    return value


def upload_format(form: UploadForm, max_bytes: int) -> str:
    """The `input_audio.format` of the uploaded clip, told by its bytes; its size checked before any work on it."""
    if form.file is None:
        raise InvalidInputError("the form has no 'file': upload the audio as the multipart field 'file'")
    what = f"the uploaded file {form.filename[:64]!r}" if form.filename else "the uploaded file"
    if not form.file:
        raise InvalidInputError(f"{what} is empty")
    if len(form.file) > max_bytes:
        raise MediaTooLargeError(f"{what} is {len(form.file)} bytes, over the limit of {max_bytes} bytes "
                                 "(--max-media-bytes)")
    container = sniff_audio_format(form.file[:SNIFF_BYTES])
    audio_format = next((name for name, holds in FORMATS.items() if container in holds), None)
    if audio_format is None:  # not a container at all, or one that holds no audio clip here (avi)
        takes = ", ".join(sorted(c for c in DEMUXERS if any(c in holds for holds in FORMATS.values())))
        raise InvalidInputError(f"{what} is not audio in a supported container ({takes})")
    return audio_format


# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------


TIMED_FORMATS = ("verbose_json", "srt", "vtt")  # the answers that give the clip's duration


@dataclass(frozen=True)
class Clip:
    """The uploaded clip as the chat request's content part, and its duration when known."""

    part: dict
    seconds: float | None


def decoded_clip(audio: memoryview | bytes, audio_format: str, limits: AudioLimits) -> Clip:
    """The clip decoded once, here, as the model's processor decodes it (`limits`: the processor's): its samples
    are the prompt's audio as they are, and its duration the answer's. On a worker thread."""
    clip = load_audio(audio, limits, audio_format)
    return Clip({"type": "audio", "audio": (clip.waveform, clip.sample_rate)}, clip.seconds)


def sent_clip(audio: memoryview | bytes, audio_format: str, limits: AudioLimits | None) -> Clip:
    """The clip as a data URL, for an encoder elsewhere (disaggregated) to decode; decoded here too only when
    `limits` are given, for a duration the answer needs. On a worker thread."""
    url = encode_data_url(audio, f"audio/{audio_format}")
    return Clip({"type": "input_audio", "input_audio": {"data": url, "format": audio_format}},
                load_audio(audio, limits, audio_format).seconds if limits is not None else None)


def _usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"type": "tokens", "input_tokens": len(out.prompt_token_ids), "output_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion}


def _avg_logprob(c: CompletionOutput) -> float | None:
    if not c.logprobs or not c.token_ids:
        return None
    total = sum(entry[tid].logprob for tid, entry in zip(c.token_ids, c.logprobs))
    mean = total / len(c.token_ids)
    return mean if math.isfinite(mean) else None


def _compression_ratio(text: str) -> float:
    """Whisper's repetition signal: the text's UTF-8 length over its zlib-compressed length."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _verbose(opts: TranscriptionOptions, out: RequestOutput, seconds: float) -> dict:
    c = out.outputs[0]
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": seconds, "text": c.text, "tokens": list(c.token_ids),
               "temperature": opts.sampling["temperature"], "avg_logprob": _avg_logprob(c),
               "compression_ratio": _compression_ratio(c.text),
               "no_speech_prob": None}  # needs a no-speech token these chat models do not have
    language = LANGUAGES[opts.language].lower() if opts.language else "unknown"  # OpenAI names it: "english"
    return {"task": opts.task, "language": language, "duration": seconds, "text": c.text, "segments": [segment],
            "usage": _usage(out)}


def _timestamp(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{decimal}{ms % 1000:03d}"


def _cue_text(text: str) -> str:
    """A cue's text: a blank line would end the cue early."""
    return re.sub(r"\n\s*\n", "\n", text.strip())


def subtitles(text: str, seconds: float, kind: str) -> str:
    """One cue spanning the whole clip, as SubRip (srt) or WebVTT (vtt): no timestamps exist inside a clip."""
    if kind == "srt":
        return f"1\n{_timestamp(0, ',')} --> {_timestamp(seconds, ',')}\n{_cue_text(text)}\n\n"
    cue = _cue_text(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # WebVTT's markup
    return f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(seconds, '.')}\n{cue}\n\n"


def answer(opts: TranscriptionOptions, out: RequestOutput, seconds: float | None) -> Response:
    text = out.outputs[0].text
    if opts.response_format == "json":
        return JSONResponse({"text": text, "usage": _usage(out)})
    if opts.response_format == "text":
        return Response(text, media_type="text/plain; charset=utf-8")
    if opts.response_format == "verbose_json":
        return JSONResponse(_verbose(opts, out, seconds))
    media_type = "text/vtt; charset=utf-8" if opts.response_format == "vtt" else "text/plain; charset=utf-8"
    return Response(subtitles(text, seconds, opts.response_format), media_type=media_type)


# ---------------------------------------------------------------------------------------------
# The handler and its routes
# ---------------------------------------------------------------------------------------------


class TranscriptionChat(OpenAIServingChat):
    """The chat handler with transcription's default output bound (DEFAULT_MAX_TOKENS, within the context). Its
    requests are built here (`TranscriptionOptions.chat_request`), never sent by a client: their audio part may
    hold the decoded clip itself."""

    python_media = True

    def max_tokens(self, prompt: PreparedPrompt, requested: int | None) -> int:
        allowed = super().max_tokens(prompt, requested)
        return allowed if requested is not None else min(allowed, DEFAULT_MAX_TOKENS)


class OpenAIServingTranscription:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = TranscriptionChat(chat.engine, chat.server, chat.model_name)
        self.engine, self.server = chat.engine, chat.server

    async def create(self, raw: HTTPRequest, task: str) -> Response:
        self.check_hears()
        boundary = multipart_boundary(raw.headers.get("content-type"))
        body = await read_body_buffer(raw, self.server.max_request_bytes, self.server.body_read_timeout)
        loop = asyncio.get_running_loop()
        form = await loop.run_in_executor(self.engine.executor, parse_form, body, boundary)
        del body  # the file is a view of it: held once
        opts = TranscriptionOptions.from_form(form.fields, task)
        self.chat.check_model(opts.model)
        audio_format = upload_format(form, self.server.max_media_bytes)
        clip = await loop.run_in_executor(self.engine.executor, self._clip, form.file, audio_format,
                                          opts.response_format in TIMED_FORMATS)
        form.file = None  # the body is freed: the prompt holds the decoded clip (or its data URL)
        request = opts.chat_request(clip.part)
        request.check_fields(self.server)
        run = await self.chat.start(raw, request, id_prefix=task)
        out = await self.chat.final(raw, run)
        return answer(opts, out, clip.seconds)

    def _clip(self, audio: memoryview | bytes, audio_format: str, timed: bool) -> Clip:
        """Decoded once, here, where this process makes the prompt's media; else sent as a data URL (and decoded
        here as well only if the answer gives its duration)."""
        limits = getattr(self.engine.input_processor.processor, "audio_limits", None)
        if limits is not None and isinstance(getattr(self.engine, "prompt_encoder", None), LocalPromptEncoder):
            return decoded_clip(audio, audio_format, limits)
        return sent_clip(audio, audio_format, AudioLimits(max_seconds=float(self.server.max_audio_seconds),
                                                          max_bytes=self.server.max_media_bytes) if timed else None)

    def check_hears(self) -> None:
        modalities = self.engine.cfg.model.modalities
        if "audio" not in modalities:
            takes = " and ".join(modalities) if modalities else "text only"
            raise InvalidInputError(f"the served model {self.chat.model_name!r} does not take audio (it takes "
                                    f"{takes}): transcriptions and translations need a model that hears, such as "
                                    "Qwen2-Audio or Qwen2.5-Omni")


def add_audio_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """OpenAI's /v1/audio/transcriptions and /v1/audio/translations, run by `chat`'s engine and limits."""
    handler = OpenAIServingTranscription(chat)

    @app.post("/v1/audio/transcriptions", openapi_extra=_form_schema(TRANSCRIBE))
    async def transcriptions(request: HTTPRequest):
        return await handler.create(request, TRANSCRIBE)

    @app.post("/v1/audio/translations", openapi_extra=_form_schema(TRANSLATE))
    async def translations(request: HTTPRequest):
        return await handler.create(request, TRANSLATE)


def _form_schema(task: str) -> dict:
    """The documented form (the handler parses the body itself, within its limits)."""
    props: dict = {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
                   "prompt": {"type": "string"}, "response_format": {"type": "string", "enum": list(RESPONSE_FORMATS)},
                   "temperature": {"type": "number"}, "max_completion_tokens": {"type": "integer"}}
    if task == TRANSCRIBE:
        props["language"] = {"type": "string", "description": "ISO-639-1 code"}
    schema = {"type": "object", "required": ["file"], "properties": props}
    return {"requestBody": {"content": {"multipart/form-data": {"schema": schema}}, "required": True}}

