"""A transcription upload on its way to the prompt, in this process: the form's file is a view of the body as
read (never copied), decoded once into the samples the chat path would decode from the same clip; where an
encoder elsewhere decodes media, it travels as a data URL of exactly its bytes."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.audio_samples import encode_audio, noise
from vlserve.frontend.chat import parse_chat_messages
from vlserve.media.audio import AudioLimits, load_audio
from vlserve.media.data_url import CHUNK, decode_data_url, encode_data_url
from vlserve.server.serving_transcription import decoded_clip, parse_form, sent_clip

CLIP = encode_audio(noise(16000 * 2, seed=4), 16000)
BOUNDARY = b"xyz"
FILE_HEAD = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'


def form_body(file: bytes, **fields: str) -> bytearray:
    parts = [FILE_HEAD + file + b"\r\n"]
    parts += [f'--xyz\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    return bytearray(b"".join(parts) + b"--xyz--\r\n")


def test_the_file_is_a_view_of_the_body():
    body = form_body(CLIP, model="m", language="en")
    form = parse_form(body, BOUNDARY)
    assert isinstance(form.file, memoryview) and form.file.obj is body and form.file == CLIP
    assert form.fields == {"model": ["m"], "language": ["en"]} and form.filename == "a.wav"


def test_a_file_holding_what_looks_like_a_boundary_is_read_whole():
    tricky = CLIP[:100] + b"\r\n--xy" + CLIP[100:] + b"\r\n--xyzz"  # starts of the boundary, inside the file
    assert parse_form(form_body(tricky), BOUNDARY).file == tricky


def test_the_decoded_clip_is_what_the_chat_path_decodes():
    limits = AudioLimits()
    clip = decoded_clip(memoryview(form_body(CLIP))[len(FILE_HEAD):len(FILE_HEAD) + len(CLIP)], "wav", limits)
    waveform, rate = clip.part["audio"]
    via_chat = load_audio("data:audio/wav;base64," + base64.b64encode(CLIP).decode(), limits)
    assert rate == limits.sample_rate and np.array_equal(waveform, via_chat.waveform) and clip.seconds == 2.0
    parsed = parse_chat_messages([{"role": "user", "content": [clip.part]}], allow_python_objects=True)
    assert parsed.media["audio"] == [clip.part["audio"]]


@pytest.mark.parametrize("size", [0, 1, 2, 3, CHUNK // 4 * 3 - 1, CHUNK // 4 * 3, CHUNK + 5])
def test_a_data_url_holds_exactly_the_bytes(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    url = encode_data_url(memoryview(bytearray(data)), "audio/wav")
    assert url.startswith("data:audio/wav;base64,") and decode_data_url(url) == data


def test_a_clip_sent_elsewhere_is_its_data_url():
    clip = sent_clip(memoryview(CLIP), "wav", None)
    assert clip.seconds is None and clip.part["input_audio"]["format"] == "wav"
    assert decode_data_url(clip.part["input_audio"]["data"]) == CLIP
    assert sent_clip(CLIP, "wav", AudioLimits()).seconds == 2.0  # decoded here only when the answer needs it
