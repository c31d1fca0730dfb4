"""/v1/audio/transcriptions and /v1/audio/translations on tiny Qwen2-Audio through the official openai client:
every response format carries the text the same request gets from /v1/chat/completions, and what the server
cannot honour or bound is refused with a 4xx that names it."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.audio_samples import encode_audio, noise
from tests.server_utils import HTTP, RemoteServer
from tests.test_audio_server import audio_ckpt, audio_part  # noqa: F401 - audio_ckpt is a fixture
from vlserve.core.config import ServerArgs
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
