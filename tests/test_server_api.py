"""`vlserve serve` end to end through the official openai client: same tokens as the offline API, streaming,
images by base64 / http / file, completions, metrics, disconnects, overload, and every kind of bad input."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.conftest import noise_image
from tests.server_utils import HTTP, RemoteServer
from vlserve import LLM, SamplingParams

KEY = "test-key"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_WAITING = 2
MAX_MEDIA_BYTES = 300_000
MAX_REQUEST_BYTES = 2_000_000
MAX_N = 16


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def user(*parts) -> list[dict]:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-media")
    noise_image(80, 60, 5).save(d / "local.png")
    return d


@pytest.fixture(scope="module")
def image_host(media_dir):
    """A plain HTTP server on loopback serving media_dir (the vlserve server allows private URLs)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(media_dir), **kw)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def server(ckpt, media_dir):
    with RemoteServer(ckpt, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                      "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                      "--allow-private-media-urls", "--allowed-local-media-path", str(media_dir),
                      "--max-media-bytes", str(MAX_MEDIA_BYTES), "--max-image-pixels", "1000000",
                      "--limit-mm-per-prompt", "image=3", "--served-model-name", "tiny", "--enable-mm-embeds",
                      "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-n", str(MAX_N), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(str(ckpt), dtype="float32", max_model_len=MAX_MODEL_LEN)


def greedy(n_tokens: int = 10) -> dict:
    return dict(model="tiny", max_tokens=n_tokens, temperature=0, extra_body={"min_tokens": n_tokens})


def offline_chat(offline, messages, n_tokens: int = 10):
    out = offline.chat(messages, SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens),
                       use_tqdm=False)[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


# ---- happy paths ------------------------------------------------------------------------------------------
def test_chat_with_base64_image_matches_offline(client, offline):
    img = noise_image(64, 48, 1)
    messages = user(image_part(data_url(img)), "What is in this picture?")
    resp = client.chat.completions.create(messages=messages, **greedy())
    text, prompt_len = offline_chat(offline, messages)
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == prompt_len and resp.usage.completion_tokens == 10
    assert resp.usage.total_tokens == prompt_len + 10
    other = client.chat.completions.create(messages=user(image_part(data_url(noise_image(64, 48, 2))),
                                                         "What is in this picture?"), **greedy())
    assert other.choices[0].message.content != text  # the picture reaches the model


def test_stream_concatenates_to_non_stream(client):
    messages = user(image_part(data_url(noise_image(56, 56, 3))), "Describe it.")
    full = client.chat.completions.create(messages=messages, **greedy(12))
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **greedy(12)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_two_images_over_http_and_base64_and_file(client, offline, image_host, media_dir):
    http_img, b64_img = noise_image(90, 60, 7), noise_image(60, 90, 8)
    http_img.save(media_dir / "remote.png")
    messages = user(image_part(f"{image_host}/remote.png"), image_part(data_url(b64_img)), "Compare them.")
    resp = client.chat.completions.create(messages=messages, **greedy())
    expected, _ = offline_chat(offline, user(image_part(data_url(http_img)), image_part(data_url(b64_img)),
                                             "Compare them."))
    assert resp.choices[0].message.content == expected
    local = client.chat.completions.create(messages=user(image_part(f"file://{media_dir}/local.png"), "Hi"),
                                           **greedy())
    assert local.choices[0].message.content == offline_chat(
        offline, user(image_part(data_url(noise_image(80, 60, 5))), "Hi"))[0]


def test_mm_processor_kwargs_change_the_prompt_length(client):
    messages = user(image_part(data_url(noise_image(224, 224, 9))), "Hi")
    small = client.chat.completions.create(messages=messages, max_tokens=1, model="tiny",
                                           extra_body={"mm_processor_kwargs": {"max_pixels": 56 * 56}})
    big = client.chat.completions.create(messages=messages, max_tokens=1, model="tiny")
    assert small.usage.prompt_tokens < big.usage.prompt_tokens


def test_completions_models_version(server, client, offline):
    resp = client.completions.create(model="tiny", prompt="The cat", max_tokens=6, temperature=0,
                                     extra_body={"min_tokens": 6})
    out = offline.generate("The cat", SamplingParams(temperature=0, max_tokens=6, min_tokens=6), use_tqdm=False)
    assert resp.choices[0].text == out[0].outputs[0].text
    many = client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 2 * 2 * 3
    streamed = list(client.completions.create(model="tiny", prompt="The cat", max_tokens=6, temperature=0,
                                              stream=True, extra_body={"min_tokens": 6}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == resp.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert HTTP.get(server.url + "/version").json()["version"]


def test_logprobs_in_chat(client):
    resp = client.chat.completions.create(messages=user("Hi"), logprobs=True, top_logprobs=3, **greedy(4))
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


# ---- bad input ----------------------------------------------------------------------------------------------
def _b64_safetensors(t) -> str:
    from safetensors.torch import save

    return base64.b64encode(save({"image_embeds": t.contiguous()})).decode()


def _big_noise_png() -> str:
    return data_url(noise_image(400, 400, 11))  # ~480 KB of incompressible noise > MAX_MEDIA_BYTES


def _bomb_png() -> str:
    from PIL import Image

    return data_url(Image.new("RGB", (1200, 1000), (10, 20, 30)))  # 1.2 MP > --max-image-pixels, tiny file


def _video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def _chat(**over) -> dict:
    return {"model": "tiny", "messages": user("hello"), "max_tokens": 4, **over}


BAD_REQUESTS = {
    "malformed json": (b'{"messages": [', 400),
    "missing messages": ({"model": "tiny"}, 400),
    "messages not a list": ({"messages": "hello"}, 400),
    "role missing": (_chat(messages=[{"content": "hi"}]), 400),
    "bad base64": (_chat(messages=user(image_part("data:image/png;base64,@@@not base64@@@"))), 400),
    "bytes that are not an image": (_chat(messages=user(image_part(
        "data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode()))), 400),
    "unsupported part type": (_chat(messages=user({"type": "audio_url", "audio_url": {"url": "x"}})), 400),
    "python-object part refused": (_chat(messages=user({"type": "image", "image": "/etc/hostname"})), 400),
    "unsupported scheme": (_chat(messages=user(image_part("ftp://example.com/a.png"))), 400),
    "file outside allowed dir": (_chat(messages=user(image_part("file:///etc/hostname"))), 400),
    "too many images": (_chat(messages=user(*[image_part(data_url(noise_image(30, 30, i))) for i in range(4)])), 400),
    "prompt + max_tokens too long": (_chat(max_tokens=MAX_MODEL_LEN), 400),
    "negative max_tokens": (_chat(max_tokens=-1), 400),
    "temperature < 0": (_chat(temperature=-0.5), 400),
    "top_p = 0": (_chat(top_p=0), 400),
    "top_p > 1": (_chat(top_p=1.5), 400),
    "temperature not a number": (_chat(temperature="hot"), 400),
    "n = 0": (_chat(n=0), 400),
    "top_logprobs too many": (_chat(logprobs=True, top_logprobs=50), 400),
    "stream_options without stream": (_chat(stream_options={"include_usage": True}), 400),
    "unknown model": (_chat(model="gpt-17"), 404),
    "bytes that are not a video": (_chat(messages=user({"type": "video_url", "video_url": {
        "url": _video_url(b"not a video at all")}})), 400),
    "too many videos": (_chat(messages=user(*[{"type": "video_url", "video_url": {"url": _video_url(b"x")}}] * 2)), 400),
    "embeddings of the wrong shape": (_chat(messages=user({"type": "image_embeds", "image_grid_thw": [1, 4, 4],
                                                           "image_embeds": _b64_safetensors(torch.zeros(3, 3))})), 400),
    "embeddings that are not safetensors": (_chat(messages=user({"type": "image_embeds", "image_grid_thw": [1, 4, 4],
                                                                 "image_embeds": "cGlja2xl"})), 400),
    "media over max bytes": (_chat(messages=user(image_part(_big_noise_png()))), 413),
    "decompression bomb": (_chat(messages=user(image_part(_bomb_png()))), 413),
    # a field that would change the answer is refused, never silently ignored
    "text part without its text": (_chat(messages=[{"role": "user", "content": [{"type": "text", "content": "hi"}]}]),
                                   400),
    "text part that is not a string": (_chat(messages=user({"type": "text", "text": 5})), 400),
    "response_format of an unknown type": (_chat(response_format={"type": "yaml"}), 400),
    "tool_choice required without tools": (_chat(tool_choice="required"), 400),
    "legacy functions": (_chat(functions=[{"name": "f", "parameters": {}}]), 400),
    "logit_bias": (_chat(logit_bias={"5": 10}), 400),
    "beam search": (_chat(use_beam_search=True), 400),
    "chat_template from the request": (_chat(chat_template="{{ messages }}"), 400),
    # bounds before work
    "n beyond --max-n": (_chat(n=MAX_N + 1), 400),
    "astronomical n": (_chat(n=2**70), 400),
    "seed beyond int64": (_chat(seed=2**64), 400),
    "top_k beyond int64": (_chat(top_k=2**64), 400),
    "stop_token_ids beyond int64": (_chat(stop_token_ids=[2**64]), 400),
    "max_tokens beyond int64": (_chat(max_tokens=2**64), 400),
    "temperature Infinity": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400),
    "repetition_penalty NaN": (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": NaN}', 400),
    "temperature overflow": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', 400),
    "lone surrogate in content": (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400),
    "lone surrogate in stop": (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', 400),
    # exact types: no bool as int, no string as number
    "n as bool": (_chat(n=True), 400),
    "max_tokens as string": (_chat(max_tokens="5"), 400),
    "stream as string": (_chat(stream="true"), 400),
    "temperature as bool": (_chat(temperature=False), 400),
    "grid of bools": (_chat(messages=user({"type": "image_embeds", "image_grid_thw": [True, 4, 4],
                                           "image_embeds": _b64_safetensors(torch.zeros(4, 64))})), 400),
    "request_id with a newline": (_chat(request_id="abc\nERROR forged line"), 400),
    "mm_processor_kwargs upscaling a 1x1 picture": (_chat(messages=user(image_part(data_url(noise_image(1, 1, 1)))),
                                                          mm_processor_kwargs={"min_pixels": 10_000_000}), 400),
    "mm_processor_kwargs max_pixels over --max-image-pixels": (
        _chat(messages=user(image_part(data_url(noise_image(30, 30, 1)))),
              mm_processor_kwargs={"max_pixels": 2_000_000}), 400),
    "body over --max-request-bytes": (_chat(messages=user("x" * (MAX_REQUEST_BYTES + 10))), 413),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_its_status_and_server_keeps_serving(server, client, case):
    body, status = BAD_REQUESTS[case]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = server.post("/v1/chat/completions", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "Traceback" not in err["message"]
    assert client.chat.completions.create(messages=user("still there?"), model="tiny", max_tokens=2).choices


def test_bad_completion_prompts(server):
    for body in ({"prompt": [], "max_tokens": 2}, {"prompt": [[99999]], "max_tokens": 2},
                 {"prompt": "x", "max_tokens": 2, "echo": True}, {"prompt": "x", "max_tokens": 0},
                 {"prompt": ["a"] * 9, "n": 2, "max_tokens": 2}, {"prompt": [True, 2], "max_tokens": 2},
                 {"prompt": "x", "max_tokens": 2, "suffix": "y"}, {"prompt": [2**64], "max_tokens": 2}):
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)


def test_client_errors_are_logged_on_one_line_and_harmless_fields_once(server, client):
    r = server.post("/v1/chat/completions", json=_chat(request_id="bad\nid"))
    assert r.status_code == 400
    for _ in range(2):
        ok = client.chat.completions.create(messages=user("hi"), model="tiny", max_tokens=2,
                                            extra_body={"some_future_field": 1})
        assert ok.choices
    log = server.read_log()
    line = next(ln for ln in log.splitlines() if "POST /v1/chat/completions -> 400" in ln and "request_id" in ln)
    assert "ERROR forged" not in log.replace(line, "")  # the request id cannot forge a log line
    assert log.count("'some_future_field' is not used") == 1


def test_seed_at_int64_max_with_n_2_wraps(client):
    resp = client.chat.completions.create(messages=user("hi"), model="tiny", max_tokens=3, n=2, seed=2**63 - 1,
                                          temperature=1.0)
    assert len(resp.choices) == 2


def test_api_docs_are_off_by_default(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert HTTP.get(server.url + path, headers=server.headers()).status_code == 404


def test_sse_escapes_line_separators():
    from vlserve.server.serving import sse

    frame = sse({"text": "a\u2028b\u2029c"})
    assert "\u2028".encode() not in frame and "\u2029".encode() not in frame
    import json
    assert json.loads(frame[len(b"data: "):])["text"] == "a\u2028b\u2029c"


def _spanning_stop(offline, messages, n_tokens: int) -> tuple[str, str]:
    """A greedy answer and a stop string that starts inside one token and ends inside a later one."""
    out = offline.chat(messages, SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens),
                       use_tqdm=False)[0].outputs[0]
    tok = offline.get_tokenizer()
    pieces = [tok.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    for i in range(1, len(pieces) - 1):
        a, b = len(pieces[i - 1]), len(pieces[i])  # token i covers text [a, b)
        if b - a >= 2 and len(pieces[i + 1]) - b >= 1:
            stop = out.text[b - 1 : b + 1]
            if out.text.find(stop) == b - 1:  # the first occurrence spans the boundary
                return out.text, stop
    pytest.skip("no token boundary to span in this answer")


def test_stream_with_stop_strings_spanning_tokens_equals_final_text(client, offline):
    messages = user("Tell me a story about the sea.")
    full, stop = _spanning_stop(offline, messages, 24)
    expected = full[: full.index(stop)]
    kw = dict(model="tiny", max_tokens=24, temperature=0, n=2, stop=[stop, "\u0001never"],
              extra_body={"min_tokens": 0})
    final = client.chat.completions.create(messages=messages, **kw)
    assert [c.message.content for c in final.choices] == [expected, expected]
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    for i in range(2):
        streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == i)
        assert streamed == expected


def test_api_key_is_required_on_v1_routes(server):
    assert HTTP.post(server.url + "/v1/chat/completions", json=_chat()).status_code == 401
    r = HTTP.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert HTTP.get(server.url + "/health").status_code == 200
    assert HTTP.get(server.url + "/ready").status_code == 200  # probes need no key; aggregated: ready when alive
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---- metrics, disconnects, overload ----------------------------------------------------------------------------
def test_metrics_move_and_repeated_picture_hits_encoder_cache(server, client):
    before = server.metrics()
    messages = user(image_part(data_url(noise_image(70, 50, 31))), "Once")
    client.chat.completions.create(messages=messages, **greedy(3))
    client.chat.completions.create(messages=messages, **greedy(3))
    after = server.metrics()
    assert after["vlserve:encoder_cache_queries_total"] - before["vlserve:encoder_cache_queries_total"] == 2
    assert after["vlserve:encoder_cache_hits_total"] - before["vlserve:encoder_cache_hits_total"] == 1
    assert after["vlserve:prefix_cache_hits_total"] > before["vlserve:prefix_cache_hits_total"]
    assert after["vlserve:generation_tokens_total"] - before["vlserve:generation_tokens_total"] == 6
    assert after["vlserve:prompt_tokens_total"] > before["vlserve:prompt_tokens_total"]
    assert after["vlserve:time_to_first_token_seconds_count"] == before["vlserve:time_to_first_token_seconds_count"] + 2
    assert after["vlserve:e2e_request_latency_seconds_count"] == before["vlserve:e2e_request_latency_seconds_count"] + 2
    assert after["vlserve:encoder_latency_seconds_count"] >= before["vlserve:encoder_latency_seconds_count"] + 1
    assert after["vlserve:inter_token_latency_seconds_count"] >= before["vlserve:inter_token_latency_seconds_count"] + 4
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"vlserve:{name}"] == 0
    assert after["vlserve:kv_cache_blocks"] > 0  # the pool's size, for a cache-aware router


def _wait_idle(server, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["vlserve:num_requests_running"] == 0 and m["vlserve:num_requests_waiting"] == 0 \
                and m["vlserve:kv_cache_usage_perc"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server did not go idle: {server.metrics()}")


def _long_completion(stream: bool = True) -> dict:
    return {"model": "tiny", "prompt": "go", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": stream}


def test_disconnected_stream_is_aborted_and_frees_blocks(server):
    before = server.metrics()
    with HTTP.stream("POST", server.url + "/v1/completions", json=_long_completion(), headers=server.headers(),
                     timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    after = _wait_idle(server)
    generated = after["vlserve:generation_tokens_total"] - before["vlserve:generation_tokens_total"]
    assert generated < MAX_MODEL_LEN - 8, "the request ran to the end although its client left"


def test_a_client_that_leaves_a_plain_request_aborts_it(server):
    """Without streaming too: the server notices the disconnect (through its API-key middleware) and stops
    generating, instead of running the request to max_tokens for nobody."""
    before = server.metrics()

    async def leave_once_it_runs():
        # The client leaves as soon as the request is seen generating, not after a fixed time: a fast machine
        # could finish all its tokens within any fixed timeout, and the test would prove nothing.
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=_long_completion(stream=False)))
            deadline = time.monotonic() + 20
            while server.metrics()["vlserve:generation_tokens_total"] == before["vlserve:generation_tokens_total"]:
                assert time.monotonic() < deadline and not task.done(), "the request never started generating"
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_once_it_runs())
    after = _wait_idle(server)
    generated = after["vlserve:generation_tokens_total"] - before["vlserve:generation_tokens_total"]
    assert generated < MAX_MODEL_LEN - 8, "the request ran to the end although its client left"


def test_full_waiting_queue_answers_503(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as http:
            tasks = [asyncio.create_task(http.post("/v1/completions", json=_long_completion(stream=False)))
                     for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
            deadline = time.monotonic() + 20
            while server.metrics()["vlserve:num_requests_waiting"] < MAX_WAITING:
                assert time.monotonic() < deadline, "requests never queued"
                await asyncio.sleep(0.05)
            refused = await http.post("/v1/chat/completions", json=_chat())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 503 and "overloaded" in refused.json()["error"]["message"]
    _wait_idle(server)
    assert server.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_uuid_stands_in_for_the_picture(server, client):
    before = server.metrics()
    for seed in (41, 42):  # different pixels, same uuid: the second is served from the encoder cache
        client.chat.completions.create(
            messages=user(image_part(data_url(noise_image(50, 50, seed)), uuid="sku-123"), "Hi"), **greedy(2))
    after = server.metrics()
    assert after["vlserve:encoder_cache_hits_total"] - before["vlserve:encoder_cache_hits_total"] == 1


def test_video_by_data_url_and_http_matches_offline(client, offline, image_host, media_dir):
    from tests.test_video import clip_frames, encode_video

    mp4 = encode_video(clip_frames(8, seed=3), fps=4)
    (media_dir / "clip.mp4").write_bytes(mp4)
    messages = user({"type": "video_url", "video_url": {"url": _video_url(mp4)}}, "What happens?")
    resp = client.chat.completions.create(messages=messages, **greedy())
    assert resp.choices[0].message.content == offline_chat(offline, messages)[0]
    over_http = client.chat.completions.create(
        messages=user({"type": "video_url", "video_url": {"url": f"{image_host}/clip.mp4"}}, "What happens?"),
        **greedy())
    assert over_http.choices[0].message.content == resp.choices[0].message.content


def test_image_embeddings_part_matches_the_picture(client, offline):
    from tests.test_mm_embeds import vit_embeddings

    image = noise_image(84, 56, 12)
    emb, grid = vit_embeddings(offline, image)
    as_picture = client.chat.completions.create(messages=user(image_part(data_url(image)), "Hi"), **greedy())
    as_embeds = client.chat.completions.create(messages=user(
        {"type": "image_embeds", "image_embeds": _b64_safetensors(emb), "image_grid_thw": list(grid)}, "Hi"),
        **greedy())
    assert as_embeds.choices[0].message.content == as_picture.choices[0].message.content
    assert as_embeds.usage.prompt_tokens == as_picture.usage.prompt_tokens
