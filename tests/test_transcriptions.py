"""/v1/audio/transcriptions and /v1/audio/translations on tiny Qwen2-Audio through the official openai client:
every response format carries the text the same request gets from /v1/chat/completions, and what the server
cannot honour or bound is refused with a 4xx that names it."""

from __future__ import annotations

import asyncio
import io
import tracemalloc
import wave
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.audio_samples import encode_audio, noise
from tests.server_utils import HTTP, RemoteServer
from tests.test_audio_server import audio_ckpt, audio_part  # noqa: F401 - audio_ckpt is a fixture
from tests.test_hostile_media import wav
from tests.test_request_validation import names_field
from vlserve.core.config import EngineArgs, Options, ServerArgs
from vlserve.core.processes import finish
from vlserve.media import audio
from vlserve.server.api_server import build_app, make_engine
from vlserve.server.errors import install_error_handlers
from vlserve.server.serving_transcription import (
    DEFAULT_MAX_TOKENS,
    TRANSCRIBE,
    TRANSLATE,
    TranscriptionChat,
    add_audio_routes,
    instruction,
)

N_TOKENS = 8
MAX_REQUEST_BYTES = 200_000  # a 3 s clip (96 kB of 16-bit samples) fits, 7 s do not
CLIP = encode_audio(noise(int(16000 * 1.6), seed=5), 16000)  # 1.6 s


@pytest.fixture(scope="module")
def server(audio_ckpt):  # noqa: F811 - the fixture imported above
    with RemoteServer(audio_ckpt, "--dtype", "float32", "--max-audio-seconds", "3",
                      "--max-request-bytes", str(MAX_REQUEST_BYTES)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server, audio_ckpt):  # noqa: F811
    c = server.client(timeout=60)
    c.served_model = str(audio_ckpt)
    return c


def chat_answer(client, text: str, clip: bytes = CLIP):
    """What /v1/chat/completions answers for the clip and the instruction: the transcription's reference."""
    messages = [{"role": "user", "content": [audio_part(clip), {"type": "text", "text": text}]}]
    return client.chat.completions.create(model=client.served_model, messages=messages, temperature=0,
                                          max_tokens=N_TOKENS)


def transcribe(client, clip: bytes = CLIP, api: str = "transcriptions", **kw):
    kw.setdefault("extra_body", {"max_completion_tokens": N_TOKENS})
    return getattr(client.audio, api).create(model=client.served_model, file=("clip.wav", clip), temperature=0, **kw)


def test_every_response_format_carries_the_chat_answer(client):
    want = chat_answer(client, instruction(TRANSCRIBE))
    text = want.choices[0].message.content
    got = transcribe(client)
    assert got.text == text
    assert (got.usage.type, got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        "tokens", want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    assert transcribe(client, response_format="text") == text
    verbose = transcribe(client, response_format="verbose_json", timestamp_granularities=["segment"])
    assert (verbose.task, verbose.language, verbose.duration, verbose.text) == ("transcribe", "unknown", 1.6, text)
    [segment] = verbose.segments
    assert (segment.id, segment.start, segment.end, segment.text, segment.temperature) == (0, 0, 1.6, text, 0)
    assert len(segment.tokens) == want.usage.completion_tokens
    assert segment.avg_logprob < 0 and segment.compression_ratio > 0 and segment.no_speech_prob is None
    cue = text.strip()
    assert transcribe(client, response_format="srt") == f"1\n00:00:00,000 --> 00:00:01,600\n{cue}\n\n"
    vtt = cue.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert transcribe(client, response_format="vtt") == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.600\n{vtt}\n\n"


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # OpenAI deprecates its translations API
def test_language_prompt_and_translation_are_the_chat_instruction(client):
    asked = instruction(TRANSCRIBE, "de", "Anna, Bert")
    assert asked.endswith("The speech is in German. Context: Anna, Bert")
    want = chat_answer(client, asked).choices[0].message.content
    assert transcribe(client, language="de", prompt="Anna, Bert").text == want
    verbose = transcribe(client, language="DE", prompt="Anna, Bert", response_format="verbose_json")
    assert (verbose.language, verbose.text) == ("german", want)
    want = chat_answer(client, instruction(TRANSLATE)).choices[0].message.content
    assert transcribe(client, api="translations").text == want
    assert transcribe(client, api="translations", response_format="verbose_json").task == "translate"


def test_what_cannot_be_honoured_or_bounded_is_refused(server, client):
    url = "/v1/audio/transcriptions"
    no_file = server.post(url, files={"model": (None, client.served_model)})
    assert no_file.status_code == 400 and "no 'file'" in no_file.text
    not_form = server.post(url, json={"file": "clip.wav"})
    assert not_form.status_code == 400 and "multipart/form-data" in not_form.text
    with pytest.raises(openai.BadRequestError, match="not audio in a supported container"):
        transcribe(client, b"hello, not a sound at all")
    with pytest.raises(openai.APIStatusError, match=r"more than the 3 s allowed \(--max-audio-seconds") as e:
        transcribe(client, encode_audio(noise(16000 * 4, seed=3), 16000))
    assert e.value.status_code == 413
    with pytest.raises(openai.APIStatusError, match=r"--max-request-bytes") as e:
        transcribe(client, encode_audio(noise(16000 * 7, seed=4), 16000))
    assert e.value.status_code == 413
    for kw, name in (({"timestamp_granularities": ["word"], "response_format": "verbose_json"},
                      "timestamp_granularities"),
                     ({"stream": True}, "stream"), ({"chunking_strategy": "auto"}, "chunking_strategy"),
                     ({"include": ["logprobs"]}, "include"), ({"response_format": "diarized_json"}, "response_format"),
                     ({"language": "xx"}, "language")):
        with pytest.raises(openai.BadRequestError, match=name):
            transcribe(client, **kw)
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", CLIP))
    assert transcribe(client).usage.output_tokens > 0  # still serving


def test_a_model_that_cannot_hear_is_refused():
    """The refusal comes before the body is read: an app around a stand-in for a vision-only engine shows it."""
    engine = SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(modalities=("image", "video"))))
    app = FastAPI()
    install_error_handlers(app)
    add_audio_routes(app, SimpleNamespace(engine=engine, server=ServerArgs(), model_name="tiny-vl"))
    resp = TestClient(app).post("/v1/audio/translations", files={"file": ("clip.wav", CLIP)})
    assert resp.status_code == 400
    assert "the served model 'tiny-vl' does not take audio (it takes image and video)" in resp.json()["error"][
        "message"]


def test_the_output_is_bounded_by_default_within_the_context():
    chat = TranscriptionChat(SimpleNamespace(cfg=SimpleNamespace(max_model_len=100_000)), ServerArgs(), "m")
    assert chat.max_tokens(SimpleNamespace(num_tokens=50), None) == DEFAULT_MAX_TOKENS
    assert chat.max_tokens(SimpleNamespace(num_tokens=99_000), None) == 1000
    assert chat.max_tokens(SimpleNamespace(num_tokens=50), 5000) == 5000  # asked for: as chat gives it


def test_a_malformed_form_is_a_400(server):
    bad = server.post("/v1/audio/transcriptions", content=b"--b\r\nContent-Disposition: form-data; name=\"file\"",
                      headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert bad.status_code == 400 and "multipart body" in bad.text
    assert HTTP.get(server.url + "/health").status_code == 200


def test_wrongly_typed_form_fields_and_malformed_wav_headers_are_400s(client):
    for name, text in (("seed", "abc"), ("top_k", "1.5"), ("temperature", "1_000"), ("max_completion_tokens", "")):
        with pytest.raises(openai.BadRequestError) as e:
            transcribe(client, extra_body={name: text})
        assert names_field(e.value.body["message"], name), e.value.body
    for clip, message in ((wav(rate=0), "a sample rate of 0 Hz"), (wav(align=0), "a block align of 0 bytes")):
        for response_format in ("json", "verbose_json"):  # verbose_json decoded the clip again, for its duration
            with pytest.raises(openai.BadRequestError, match=message):
                transcribe(client, clip, response_format=response_format)


def big_wav(seconds: float, rate: int = 48000, channels: int = 6) -> bytes:
    """A 16-bit multichannel WAV of noise (about 17 MB for 29 s), written by the standard library."""
    samples = np.random.default_rng(3).integers(-3000, 3000, (int(rate * seconds), channels), dtype=np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def test_an_upload_is_decoded_once_and_never_copied_whole(audio_ckpt, monkeypatch):  # noqa: F811
    """verbose_json decoded the clip twice (for the prompt, then for its duration), and the front end held a
    17 MB upload about seven times over (the form part, its bytes, base64 bytes and text, the data URL, the
    decoded payload twice): 7.2 times its size traced at the peak, 1.5 now (the body as read, the client's share
    of it, the decoded clip). Here: the server's app around an engine, in this process (as run-batch runs it),
    with every Python allocation of the request traced."""
    decodes = []
    real = audio._decode
    monkeypatch.setattr(audio, "_decode", lambda *a, **kw: decodes.append(a[1]) or real(*a, **kw))
    upload = big_wav(29)
    opts = Options(engine=EngineArgs(model=str(audio_ckpt), dtype="float32"), server=ServerArgs())

    async def transcribe_once() -> tuple[httpx.Response, int]:
        engine = make_engine(opts)
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=build_app(engine, opts.server))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=300) as http:
                tracemalloc.start()
                try:
                    r = await http.post("/v1/audio/transcriptions", files={"file": ("clip.wav", upload)},
                                        data={"response_format": "verbose_json", "max_completion_tokens": "2"})
                    return r, tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
        finally:
            await finish(engine.shutdown())

    response, peak = asyncio.run(transcribe_once())
    assert response.status_code == 200, response.text
    assert response.json()["duration"] == 29.0
    assert decodes == ["wav"]
    assert peak < 2.5 * len(upload), f"{peak / 2**20:.0f} MiB traced at most for a {len(upload) / 2**20:.0f} MiB upload"
