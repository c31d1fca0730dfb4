"""InternVL3 through everything that serves it besides the engine's own parity (tests/test_internvl_parity.py).

Disaggregated, every role its own process on loopback, through the openai client: an encoder feeding a language
server (E->PD) and a prefill instance whose KV goes to a decode instance (E->P->D), receive allocations small
enough that every media and KV transfer resumes; a picture and a video (its frames encoded one by one) answer as
the offline `LLM` does. The aggregated OpenAI server: a picture chat streamed or not, a picture with a video,
structured outputs, bad input refused with a 4xx and every KV block back. int8 weights: loaded, tower run.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from PIL import Image

from tests.conftest import assert_pool_full
from tests.server_utils import RemoteServer, scrape
from tests.test_disagg import Cluster, data_url, wait_encoder_idle, wait_language_blocks_free
from tests.test_llava_serving import N_TOKENS, SMALL_MEDIA, ask, chat, image_part, streamed_text, video_part
from tests.test_server_api import _wait_idle
from tests.test_structured_outputs import PERSON
from vlserve import LLM, SamplingParams
from vlserve.model.layers.quantized_linear import Int8Linear

LIMITS = "image=2,video=1"


@pytest.fixture(scope="module")
def internvl(tiny_ckpt) -> str:
    return str(tiny_ckpt("internvl3"))


@pytest.fixture(scope="module")
def offline(internvl):
    return LLM(internvl, dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 2, "video": 1})


def offline_answer(llm: LLM, messages, n_tokens: int = N_TOKENS) -> tuple[str, int]:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens),
                   use_tqdm=False)[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


# ---- disaggregated: E->PD and E->P->D ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(internvl):
    """Bootstrap, encoder A, language server L (E->PD); prefill P and decode D (E->P->D), all on one encoder."""
    c = Cluster(internvl, {"L": SMALL_MEDIA, "D": ["--kv-allocate-tokens", "32"]}, prefills={"P": SMALL_MEDIA},
                limits=LIMITS, roles={"L": "language"})
    yield c
    c.close_quickly()


def test_e_pd_and_e_p_d_answer_as_the_offline_engine_with_every_transfer_resumed(cluster, offline):
    c = cluster
    c.wait_encoders("L", 1)
    c.wait_prefills("D", 1)
    picture, video = chat(image_part(1)), chat(video_part(2, frames=4), text="What happens?")
    for messages in (picture, video):
        want = offline_answer(offline, messages)
        for name in ("L", "D"):
            resp = ask(c.client(name), messages)
            assert (resp.choices[0].message.content, resp.usage.prompt_tokens) == want, name
    assert streamed_text(ask(c.client("D"), picture, stream=True)) == offline_answer(offline, picture)[0]
    assert c.metrics("L")['vlserve:embedding_transfer_resumes_total{role="language"}'] > 0
    assert scrape(c.prefills["P"].metrics_url)['vlserve:embedding_transfer_resumes_total{role="prefill"}'] > 0
    assert c.metrics("D")['vlserve:kv_transfer_resumes_total{role="decode"}'] > 0
    enc = scrape(c.encoders["A"].metrics_url)
    # the language server's and the prefill instance's picture (the second from the encoder cache) and frames
    assert enc['vlserve:mm_items_total{modality="image"}'] == 3
    assert enc['vlserve:mm_items_total{modality="video"}'] == 2 * 4
    wait_language_blocks_free(lambda: c.metrics("L"))
    wait_encoder_idle(c.encoders["A"].metrics_url)


# ---- the aggregated OpenAI server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(internvl):
    with RemoteServer(internvl, "--dtype", "float32", "--max-model-len", "2048", "--limit-mm-per-prompt", LIMITS,
                      "--max-image-pixels", "1000000") as s:
        yield s


@pytest.fixture(scope="module")
def client(server, internvl):
    c = server.client(timeout=60)
    c.served_model = internvl
    return c


def test_picture_chat_streamed_equals_whole_and_the_offline_engine(client, offline):
    messages = chat(image_part(11, 150, 90))
    resp = ask(client, messages)
    assert (resp.choices[0].message.content, resp.usage.prompt_tokens) == offline_answer(offline, messages)
    assert resp.usage.completion_tokens == N_TOKENS
    assert streamed_text(ask(client, messages, stream=True)) == resp.choices[0].message.content
    two = chat(image_part(12), video_part(13, frames=3), text="Compare.")
    assert ask(client, two).choices[0].message.content == offline_answer(offline, two)[0]
    tiles = ask(client, messages, extra={"mm_processor_kwargs": {"max_patches": 1}})
    assert tiles.usage.prompt_tokens < resp.usage.prompt_tokens  # one tile instead of 3 and a thumbnail


def test_structured_outputs_are_schema_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for stream in (False, True):
        resp = client.chat.completions.create(model=client.served_model, messages=chat(image_part(21)),
                                              response_format=fmt, max_tokens=120, temperature=0, stream=stream)
        text = streamed_text(resp) if stream else resp.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("messages, extra, status, match", [
    (chat(*[image_part(40 + i) for i in range(3)]), {}, 400, "image"),
    (chat(image_part(45)), {"mm_processor_kwargs": {"fps": 2}}, 400, "fps"),
    (chat(image_part(46)), {"mm_processor_kwargs": {"max_patches": 0}}, 400, "max_patches"),
    (chat(video_part(47)), {"mm_processor_kwargs": {"max_frames": 10_000}}, 400, "max_frames"),
    (chat({"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (1200, 1000)))}}), {}, 413,
     "1000000 allowed"),
], ids=["three pictures", "unknown kwarg", "no tiles", "too many frames", "huge picture"])
def test_bad_input_gets_a_4xx_and_the_pool_returns_full(server, client, messages, extra, status, match):
    with pytest.raises(openai.APIStatusError, match=match) as e:
        ask(client, messages, extra=extra)
    assert e.value.status_code == status
    assert ask(client, chat(image_part(48))).usage.completion_tokens == N_TOKENS  # still serving
    _wait_idle(server)


# ---- int8 -------------------------------------------------------------------------------------------------------
def test_int8_loads_and_generates_with_pictures_and_videos(internvl):
    """Every decoder linear int8, the tower and projector as loaded; pictures and a video run through the tower
    (every tile and frame encoded) and every answer has its length; nothing held afterwards."""
    llm = LLM(internvl, dtype="float32", quantization="int8", max_model_len=2048,
              limit_mm_per_prompt={"image": 2, "video": 1})
    model = llm.engine.core.runner.model
    kinds = {type(m) for m in model.language_model.layers.modules()}
    assert Int8Linear in kinds and torch.nn.Linear not in kinds
    # the towers and projector stay as loaded; the LM head goes int8 with the decoder
    assert not any(isinstance(m, Int8Linear) for name, m in model.named_modules()
                   if "language_model" not in name and name != "lm_head")
    assert isinstance(model.lm_head, Int8Linear)
    conversations = [chat(image_part(51)), chat(image_part(52, 200, 60), image_part(53, 40, 90), text="Both?"),
                     chat(video_part(54, frames=3), text="What happens?"), [{"role": "user", "content": "Text."}]]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [N_TOKENS] * 4
    assert len(outs[1].prompt_token_ids) > len(outs[0].prompt_token_ids) > len(outs[3].prompt_token_ids) + 10
    assert llm.get_metrics()["encoder_cache_queries_total"] == 3 + 3  # three pictures and three frames
    assert_pool_full(llm)
