"""LLaVA through everything that serves it besides the engine's own parity (tests/test_llava_parity.py).

Tiny LLaVA-OneVision: disaggregated, every role its own process on loopback, through the openai client: an encoder
feeding a language server (E->PD) and a prefill instance whose KV goes to a decode instance (E->P->D), receive
allocations small enough that every media and KV transfer resumes; a picture and a video answer as the offline
`LLM` does. An encoder of another family (Qwen2-VL) joining the registry is never paired. The aggregated OpenAI
server: a picture chat streamed or not, structured outputs, tool calls (the tiny templates, like the llava-hf
checkpoints', have no tools section: the hermes fallback of vlserve/frontend/tool_prompt.py), bad input refused
with a 4xx and every KV block back. int8 weights for both families (LLaVA-NeXT-Video too): loaded, towers run.
"""

from __future__ import annotations

import base64
import json

import jsonschema
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from tests.audio_samples import encode_audio, noise
from tests.conftest import assert_pool_full, noise_image
from tests.server_utils import RemoteServer, RoleProcess, free_port, scrape
from tests.test_audio_server import audio_part
from tests.test_disagg import Cluster, data_url, wait_encoder_idle, wait_language_blocks_free, wait_until
from tests.test_server_api import _wait_idle
from tests.test_structured_outputs import PERSON
from tests.test_tool_calls import TOOLS
from tests.test_video import clip_frames, encode_video
from vlserve import LLM, SamplingParams
from vlserve.frontend.tokenizer import render_chat
from vlserve.model.layers.quantized_linear import Int8Linear

N_TOKENS = 8
LIMITS = "image=2,video=1"
# media rows arrive 8 at a time (a 120x80 picture has 120 rows, an 8-frame clip 33), prompt KV 32 tokens at a
# time: every transfer resumes
SMALL_MEDIA = ["--media-allocate-rows", "8", "--receive-block-rows", "4", "--media-buffer-blocks", "64"]


def image_part(seed: int, width: int = 120, height: int = 80) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(noise_image(width, height, seed))}}


def video_part(seed: int, frames: int = 8) -> dict:
    mp4 = encode_video(clip_frames(frames, seed=seed), fps=4)
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}}


def chat(*parts: dict, text: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ask(client: openai.OpenAI, messages, n_tokens: int = N_TOKENS, extra: dict | None = None, **kw):
    return client.chat.completions.create(model=client.served_model, messages=messages, temperature=0,
                                          max_tokens=n_tokens, extra_body={"min_tokens": n_tokens, **(extra or {})},
                                          **kw)


def streamed_text(chunks) -> str:
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.fixture(scope="module")
def onevision(tiny_ckpt) -> str:
    return str(tiny_ckpt("llava_onevision"))


@pytest.fixture(scope="module")
def offline(onevision):
    return LLM(onevision, dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 2, "video": 1})


def offline_answer(llm: LLM, messages, n_tokens: int = N_TOKENS) -> tuple[str, int]:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens),
                   use_tqdm=False)[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


# ---- disaggregated: E->PD and E->P->D ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(onevision):
    """Bootstrap, encoder A, language server L (E->PD); prefill P and decode D (E->P->D), all on one encoder."""
    c = Cluster(onevision, {"L": SMALL_MEDIA, "D": ["--kv-allocate-tokens", "32"]}, prefills={"P": SMALL_MEDIA},
                limits=LIMITS, roles={"L": "language"})
    yield c
    c.close_quickly()


def test_e_pd_and_e_p_d_answer_as_the_offline_engine_with_every_transfer_resumed(cluster, offline):
    c = cluster
    c.wait_encoders("L", 1)
    c.wait_prefills("D", 1)
    picture, video = chat(image_part(1)), chat(video_part(2), text="What happens?")
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
    # the language server's and the prefill instance's; the prefill's second picture from the encoder cache
    assert (enc['vlserve:mm_items_total{modality="image"}'], enc['vlserve:mm_items_total{modality="video"}']) == (3, 2)
    wait_language_blocks_free(lambda: c.metrics("L"))
    wait_encoder_idle(c.encoders["A"].metrics_url)


def test_bad_media_is_refused_through_the_encoder_with_the_aggregated_status(cluster):
    """The encoder's processor refuses the client's mistakes (its kwargs reached it); the language server answers
    with the aggregated server's status, and every receive block comes back."""
    client = cluster.client("L")
    not_a_video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,aGVsbG8="}}
    for messages, extra, match in [(chat(video_part(4)), {"mm_processor_kwargs": {"max_frames": 64}}, "max_frames"),
                                   (chat(image_part(5)), {"mm_processor_kwargs": {"fps": 2}}, "fps"),
                                   (chat(not_a_video), {}, "video")]:
        with pytest.raises(openai.BadRequestError, match=match):
            ask(client, messages, extra=extra)
    assert ask(client, chat(image_part(6))).usage.completion_tokens == N_TOKENS
    wait_language_blocks_free(lambda: cluster.metrics("L"))
    wait_encoder_idle(cluster.encoders["A"].metrics_url)


def test_an_encoder_of_another_family_is_never_paired(cluster, offline, tiny_ckpt):
    """A Qwen2-VL encoder registering beside the LLaVA one: the language server and the prefill instance refuse it
    at pairing, naming both models; requests keep going to the LLaVA encoder."""
    c = cluster
    c.wait_encoders("L", 1)
    common = list(c.common)
    common[common.index("--model") + 1] = str(tiny_ckpt("qwen2_vl"))
    port = free_port()
    rogue = RoleProcess("encoder-qwen2-vl", ["encode", *common, "--port", str(port), "--data-port", str(free_port())],
                        f"http://127.0.0.1:{port}/health", env=c.encoder_env)
    c.procs.append(rogue)
    rogue.wait_healthy()
    for role in (c.languages["L"], c.prefills["P"]):
        wait_until(lambda: "not paired" in role.read_log(), f"{role.name} never refused the Qwen2-VL encoder")
        line = next(x for x in role.read_log().splitlines() if "not paired" in x)
        assert "Qwen2VLForConditionalGeneration" in line and "LlavaOnevisionForConditionalGeneration" in line, line
    assert c.metrics("L")["vlserve:encoders_available"] == 1
    messages = chat(image_part(3))
    for name in ("L", "D"):
        assert ask(c.client(name), messages).choices[0].message.content == offline_answer(offline, messages)[0]
    assert scrape(rogue.health_url.replace("/health", "/metrics"))['vlserve:mm_items_total{modality="image"}'] == 0
    wait_language_blocks_free(lambda: c.metrics("L"))


# ---- the aggregated OpenAI server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(onevision):
    with RemoteServer(onevision, "--dtype", "float32", "--max-model-len", "2048", "--limit-mm-per-prompt", LIMITS,
                      "--max-image-pixels", "1000000") as s:
        yield s


@pytest.fixture(scope="module")
def client(server, onevision):
    c = server.client(timeout=60)
    c.served_model = onevision
    return c


def test_picture_chat_streamed_equals_whole_and_the_offline_engine(client, offline):
    messages = chat(image_part(11, 150, 90))
    resp = ask(client, messages)
    assert (resp.choices[0].message.content, resp.usage.prompt_tokens) == offline_answer(offline, messages)
    assert resp.usage.completion_tokens == N_TOKENS
    assert streamed_text(ask(client, messages, stream=True)) == resp.choices[0].message.content
    two = chat(image_part(12), video_part(13), text="Compare.")
    assert ask(client, two).choices[0].message.content == offline_answer(offline, two)[0]


def test_structured_outputs_are_schema_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for stream in (False, True):
        resp = client.chat.completions.create(model=client.served_model, messages=chat(image_part(21)),
                                              response_format=fmt, max_tokens=120, temperature=0, stream=stream)
        text = streamed_text(resp) if stream else resp.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


def test_tool_calls_through_the_hermes_fallback(client, onevision):
    tok = AutoTokenizer.from_pretrained(onevision)
    assert "tools" not in tok.chat_template  # as in llava-onevision-qwen2-*-ov-hf: the tools go into the system turn
    prompt = render_chat(tok, [{"role": "user", "content": "Weather?"}], tools=TOOLS)
    assert prompt.startswith("<|im_start|>system \nYou are a helpful assistant.\n\n# Tools")
    assert '"get_weather"' in prompt and "<tool_call>" in prompt
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = client.chat.completions.create(model=client.served_model, messages=chat(image_part(31)), tools=TOOLS,
                                              tool_choice=choice, max_tokens=120, temperature=0)
        answer = resp.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        for call in answer.message.tool_calls:
            fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
        if isinstance(choice, dict):
            assert {call.function.name for call in answer.message.tool_calls} == {"get_weather"}
    # a conversation with a call and its result, a picture inside the result: the picture's rows are in the prompt
    history = [{"role": "user", "content": "Weather in Oslo, and the radar?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]}]
    result = [{"type": "text", "text": "Rain. Radar:"}, image_part(32)]
    with_picture = ask(client, history + [{"role": "tool", "tool_call_id": "call_1", "content": result}],
                       n_tokens=4, tools=TOOLS, tool_choice="none")
    without = ask(client, history + [{"role": "tool", "tool_call_id": "call_1", "content": "Rain."}], n_tokens=4,
                  tools=TOOLS, tool_choice="none")
    assert with_picture.usage.prompt_tokens > without.usage.prompt_tokens + 100  # 120 rows
    assert with_picture.choices[0].message.tool_calls is None


@pytest.mark.parametrize("messages, extra, status, match", [
    (chat(*[image_part(40 + i) for i in range(3)]), {}, 400, "image"),
    (chat(video_part(43), video_part(44)), {}, 400, "video"),
    (chat(audio_part(encode_audio(noise(8000, seed=1), 16000))), {}, 400, "audio"),
    (chat(image_part(45)), {"mm_processor_kwargs": {"fps": 2}}, 400, "fps"),
    (chat(video_part(46)), {"mm_processor_kwargs": {"max_frames": 10_000}}, 400, "max_frames"),
    (chat({"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (1200, 1000)))}}), {}, 413,
     "1000000 allowed"),
], ids=["three pictures", "two videos", "sound", "unknown kwarg", "too many frames", "huge picture"])
def test_bad_input_gets_a_4xx_and_the_pool_returns_full(server, client, messages, extra, status, match):
    with pytest.raises(openai.APIStatusError, match=match) as e:
        ask(client, messages, extra=extra)
    assert e.value.status_code == status
    assert ask(client, chat(image_part(48))).usage.completion_tokens == N_TOKENS  # still serving
    _wait_idle(server)


# ---- int8 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_int8_loads_and_generates_with_pictures_and_videos(tiny_ckpt, arch):
    """Every decoder linear int8, the tower and projector as loaded; pictures and a video run through the tower
    (each item encoded) and every answer has its length; nothing held afterwards."""
    llm = LLM(str(tiny_ckpt(arch)), dtype="float32", quantization="int8", max_model_len=2048,
              limit_mm_per_prompt={"image": 2, "video": 1})
    model = llm.engine.core.runner.model
    kinds = {type(m) for m in model.language_model.layers.modules()}
    assert Int8Linear in kinds and torch.nn.Linear not in kinds
    # the towers and projector stay as loaded; the LM head goes int8 with the decoder
    assert not any(isinstance(m, Int8Linear) for name, m in model.named_modules()
                   if "language_model" not in name and name != "lm_head")
    assert isinstance(model.lm_head, Int8Linear)
    conversations = [chat(image_part(51)), chat(image_part(52, 200, 60), image_part(53, 40, 90), text="Both?"),
                     chat(video_part(54), text="What happens?"), [{"role": "user", "content": "Text only."}]]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [N_TOKENS] * 4
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len(outs[1].prompt_token_ids) > len(outs[0].prompt_token_ids) > len(outs[3].prompt_token_ids) + 50
    assert llm.get_metrics()["encoder_cache_queries_total"] == 4  # three pictures and a video went to the tower
    assert_pool_full(llm)
