"""`vlserve serve` of tiny Qwen2-Audio through the official openai client: an `input_audio` chat part gets
transformers' greedy tokens (streamed or not), bad audio gets a 4xx naming the fault, and /metrics counts media
items by modality and times the audio tower."""

from __future__ import annotations

import io
import wave

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.audio_samples import b64, encode_audio, noise, sine
from tests.hf_reference import HFAudioReference
from tests.server_utils import RemoteServer, scrape

N_TOKENS = 8
QUESTION = "What do you hear?"


@pytest.fixture(scope="module")
def audio_ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_audio")


@pytest.fixture(scope="module")
def server(audio_ckpt):
    with RemoteServer(audio_ckpt, "--dtype", "float32", "--max-audio-seconds", "3") as s:
        yield s


def wav_samples(data: bytes) -> np.ndarray:
    """A 16-bit mono wav's samples as floats, read with the standard library (not with vlserve's decoder)."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def audio_chat(data: bytes, fmt: str = "wav") -> list[dict]:
    return [{"role": "user", "content": [audio_part(data, fmt), {"type": "text", "text": QUESTION}]}]


def reference(path, clip: np.ndarray) -> tuple[str, int]:
    """transformers' greedy text and prompt length for audio_chat's prompt (the checkpoint's chat template)."""
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"},
                                                                   {"type": "text", "text": QUESTION}]}],
                                     tokenize=False, add_generation_prompt=True)
    prompt_ids, new_ids = HFAudioReference(path).greedy(prompt, [clip], N_TOKENS)
    return tok.decode(new_ids, skip_special_tokens=True), len(prompt_ids)


def ask(client: openai.OpenAI, messages, **kw):
    return client.chat.completions.create(model=client.served_model, messages=messages, temperature=0,
                                          max_tokens=N_TOKENS, extra_body={"min_tokens": N_TOKENS}, **kw)


@pytest.fixture(scope="module")
def client(server, audio_ckpt):
    c = server.client(timeout=60)
    c.served_model = str(audio_ckpt)
    return c


def test_input_audio_chat_equals_transformers_streamed_or_not(server, client, audio_ckpt):
    data = encode_audio(noise(int(16000 * 1.6), seed=11), 16000)
    want, prompt_len = reference(audio_ckpt, wav_samples(data))
    resp = ask(client, audio_chat(data))
    assert resp.choices[0].message.content == want
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_len, N_TOKENS)
    chunks = list(ask(client, audio_chat(data), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # another sound, another prompt length (1.6 s: 40 audio tokens; 0.8 s: 20), the reference's again
    other = encode_audio(sine(0.8), 16000)
    want_other, other_len = reference(audio_ckpt, wav_samples(other))
    resp = ask(client, audio_chat(other))
    assert (resp.choices[0].message.content, resp.usage.prompt_tokens) == (want_other, other_len)
    assert other_len == prompt_len - 20


def test_bad_audio_gets_a_clear_4xx(client):
    wav = encode_audio(noise(8000, seed=2), 16000)
    with pytest.raises(openai.BadRequestError, match="'mp3' but the data is wav"):
        ask(client, audio_chat(wav, "mp3"))
    with pytest.raises(openai.BadRequestError, match="not supported"):
        ask(client, audio_chat(wav, "pcm16"))
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, audio_chat(b"hello, not a sound at all"))
    assert "audio" in str(e.value).lower()
    with pytest.raises(openai.APIStatusError, match=r"more than the 3 s allowed \(--max-audio-seconds") as e:
        ask(client, audio_chat(encode_audio(noise(16000 * 4, seed=3), 16000)))
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="base64"):
        ask(client, [{"role": "user", "content": [{"type": "input_audio",
                                                   "input_audio": {"data": "%%% not base64", "format": "wav"}}]}])
    assert ask(client, audio_chat(wav)).usage.completion_tokens == N_TOKENS  # still serving


def test_metrics_count_audio_items_and_time_the_audio_tower(server, client, audio_ckpt):
    def audio_items() -> float:
        return scrape(server.url + "/metrics")[
            f'vlserve:mm_items_total{{modality="audio",model_name="{audio_ckpt}"}}']

    before = audio_items()
    clips = [encode_audio(noise(4000 + 800 * i, seed=20 + i), 16000) for i in range(2)]
    ask(client, [{"role": "user", "content": [audio_part(clips[0]), audio_part(clips[1]),
                                              {"type": "text", "text": "Compare."}]}])
    m = scrape(server.url + "/metrics")
    assert audio_items() == before + 2
    assert m[f'vlserve:encoder_latency_seconds_count{{model_name="{audio_ckpt}",tower="audio"}}'] > 0
    # the model has no vision tower: no picture series
    assert not any('modality="image"' in k or 'tower="vision"' in k for k in m), m
