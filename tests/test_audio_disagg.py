"""Audio through disaggregated roles, every role its own process on loopback, through the openai client.

Tiny Qwen2-Audio: one encoder feeding a language server (E->PD) and a prefill instance whose KV goes to a decode
instance (E->P->D), receive allocations small enough that every media and KV transfer resumes; both answer with
transformers' greedy tokens. Tiny Qwen2.5-Omni: encoders holding one tower each (`--towers`) get only the prompts
they can encode; a prompt with sound and a picture waits for an encoder that encodes both, and is refused with a
clear 503 when none comes (that such an encoder gets it: tests/test_encoder_towers.py)."""

from __future__ import annotations

import openai
import pytest

from tests.audio_samples import encode_audio, noise
from tests.conftest import noise_image
from tests.server_utils import scrape
from tests.test_audio_server import N_TOKENS, ask, audio_chat, audio_part, reference, wav_samples
from tests.test_disagg import Cluster, data_url, wait_encoder_idle, wait_language_blocks_free
from vlserve import LLM, SamplingParams

# media rows arrive 8 at a time (a 1.6 s clip has 40), prompt KV 32 tokens at a time: every transfer resumes
SMALL_MEDIA = ["--media-allocate-rows", "8", "--receive-block-rows", "4", "--media-buffer-blocks", "64"]


@pytest.fixture(scope="module")
def audio_cluster(tiny_ckpt):
    """Bootstrap, encoder A, prefill P, decode D and language server L (tiny Qwen2-Audio)."""
    c = Cluster(tiny_ckpt("qwen2_audio"), {"D": ["--kv-allocate-tokens", "32"], "L": SMALL_MEDIA},
                prefills={"P": SMALL_MEDIA}, limits="audio=4", roles={"L": "language"})
    c.served = str(tiny_ckpt("qwen2_audio"))
    yield c
    c.close_quickly()


def _client(cluster: Cluster, name: str) -> openai.OpenAI:
    client = cluster.client(name)
    client.served_model = cluster.served
    return client


def test_e_pd_and_e_p_d_answer_like_transformers_with_every_transfer_resumed(audio_cluster, tiny_ckpt):
    c = audio_cluster
    data = encode_audio(noise(int(16000 * 1.6), seed=31), 16000)
    want, prompt_len = reference(tiny_ckpt("qwen2_audio"), wav_samples(data))
    c.wait_encoders("L", 1)
    c.wait_prefills("D", 1)
    for name in ("L", "D"):
        resp = ask(_client(c, name), audio_chat(data))
        assert (resp.choices[0].message.content, resp.usage.prompt_tokens) == (want, prompt_len), name
    chunks = list(ask(_client(c, "D"), audio_chat(data), stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert c.metrics("L")['vlserve:embedding_transfer_resumes_total{role="language"}'] > 0
    assert scrape(c.prefills["P"].metrics_url)['vlserve:embedding_transfer_resumes_total{role="prefill"}'] > 0
    assert c.metrics("D")['vlserve:kv_transfer_resumes_total{role="decode"}'] > 0
    enc = scrape(c.encoders["A"].metrics_url)
    assert enc['vlserve:mm_items_total{modality="audio"}'] == 3  # the language server's, and the prefill's twice
    assert enc['vlserve:encoder_latency_seconds_count{tower="audio"}'] >= 1  # (later ones from its cache)
    wait_language_blocks_free(lambda: c.metrics("L"))
    wait_encoder_idle(c.encoders["A"].metrics_url)


def test_bad_audio_is_refused_by_the_encoder_with_the_aggregated_status(audio_cluster):
    client = _client(audio_cluster, "L")
    wav = encode_audio(noise(8000, seed=2), 16000)
    with pytest.raises(openai.BadRequestError, match="'mp3' but the data is wav"):
        ask(client, audio_chat(wav, "mp3"))
    with pytest.raises(openai.APIStatusError, match="more than the 30 s") as e:
        ask(client, audio_chat(encode_audio(noise(16000 * 31, seed=3), 16000)))
    assert e.value.status_code == 413
    wait_language_blocks_free(lambda: audio_cluster.metrics("L"))


# ---- routing by modality (tiny Qwen2.5-Omni) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def omni_cluster(tiny_ckpt):
    """Bootstrap, encoder A (audio tower only), encoder V (vision tower only), language server "main"."""
    path = tiny_ckpt("qwen2_5_omni")
    c = Cluster(path, {"main": ["--peer-wait-timeout", "1"]}, limits="image=2,audio=2",
                encoders={"A": ("--towers", "audio"), "V": ("--towers", "vision")})
    c.served = str(path)
    yield c
    c.close_quickly()


@pytest.fixture(scope="module")
def omni_offline(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_5_omni")), dtype="float32", max_model_len=2048,
               limit_mm_per_prompt={"image": 2, "audio": 2})


def _offline_text(llm: LLM, messages) -> str:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def _items(cluster: Cluster, encoder: str) -> dict[str, float]:
    m = scrape(cluster.encoders[encoder].metrics_url)
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith("vlserve:mm_items_total{")}


def test_each_prompt_goes_to_an_encoder_that_encodes_all_its_kinds(omni_cluster, omni_offline):
    c = omni_cluster
    client = _client(c, "main")
    c.wait_encoders("main", 2)
    assert (_items(c, "A"), _items(c, "V")) == ({"audio": 0}, {"image": 0, "video": 0})  # what each announces
    sound = audio_part(encode_audio(noise(int(16000 * 1.2), seed=41), 16000))
    picture = {"type": "image_url", "image_url": {"url": data_url(noise_image(56, 56, 42))}}
    hear = [{"role": "user", "content": [sound, {"type": "text", "text": "What is it?"}]}]
    see = [{"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}]
    both = [{"role": "user", "content": [sound, picture, {"type": "text", "text": "Both?"}]}]
    for messages in (hear, see, hear, see):
        assert ask(client, messages).choices[0].message.content == _offline_text(omni_offline, messages)
    assert (_items(c, "A"), _items(c, "V")) == ({"audio": 2}, {"image": 2, "video": 0})
    # sound and a picture: no encoder encodes both, so no encoder is sent it, and the wait ends in a clear 503
    with pytest.raises(openai.InternalServerError, match="no encoder that encodes audio and image is available") as e:
        ask(client, both)
    assert e.value.status_code == 503
    assert (_items(c, "A"), _items(c, "V")) == ({"audio": 2}, {"image": 2, "video": 0})
    assert ask(client, hear).choices[0].message.content == _offline_text(omni_offline, hear)  # still serving
    wait_language_blocks_free(lambda: c.metrics("main"))
    for name in c.encoders:
        wait_encoder_idle(c.encoders[name].metrics_url)
