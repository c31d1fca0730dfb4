"""`vlserve bench serve`: the random multimodal dataset, the metrics, and one run against a fake server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from vlserve.bench.dataset import RandomMMConfig, build_requests, parse_audio_seconds, parse_image_sizes
from vlserve.bench.serve import RequestRecord, compute_metrics, format_table
from vlserve.cli import main


def image_urls(req) -> list[str]:
    return [p["image_url"]["url"] for p in req.messages[0]["content"] if p["type"] == "image_url"]


def text_of(req) -> str:
    return next(p["text"] for p in req.messages[0]["content"] if p["type"] == "text")


# --------------------------------------------------------------------------------------------- dataset


def test_dataset_is_deterministic_per_seed():
    cfg = dict(num_prompts=6, input_len=10, output_len=4, range_ratio=0.5, image_sizes=[(16, 16), (24, 8)],
               images_per_request=1, max_images_per_request=3, repeat_image_ratio=0.3)
    a = build_requests(RandomMMConfig(**cfg, seed=3))
    b = build_requests(RandomMMConfig(**cfg, seed=3))
    c = build_requests(RandomMMConfig(**cfg, seed=4))
    assert [r.messages for r in a] == [r.messages for r in b]
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    assert [r.messages for r in a] != [r.messages for r in c]


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_image_count_sizes_and_format(fmt):
    sizes = [(16, 16), (32, 8)]
    reqs = build_requests(RandomMMConfig(num_prompts=5, input_len=4, output_len=2, image_sizes=sizes,
                                         images_per_request=2, image_format=fmt))
    seen = set()
    for r in reqs:
        urls = image_urls(r)
        assert r.num_images == len(urls) == 2
        content = r.messages[0]["content"]
        assert r.messages[0]["role"] == "user" and content[-1]["type"] == "text"  # pictures first
        for url in urls:
            head, data = url.split(",", 1)
            assert head == f"data:image/{fmt};base64"
            img = Image.open(io.BytesIO(base64.b64decode(data)))
            assert img.format == fmt.upper() and img.size in sizes
            seen.add(img.size)
    assert seen == set(sizes)


def test_image_count_range():
    reqs = build_requests(RandomMMConfig(num_prompts=40, input_len=2, output_len=2, image_sizes=[(8, 8)],
                                         images_per_request=0, max_images_per_request=3))
    counts = [r.num_images for r in reqs]
    assert all(len(image_urls(r)) == r.num_images for r in reqs)
    assert set(counts) == {0, 1, 2, 3}


def test_repeat_ratio_reuses_identical_urls():
    base = dict(num_prompts=100, input_len=2, output_len=2, image_sizes=[(8, 8)], images_per_request=2)
    fresh = [u for r in build_requests(RandomMMConfig(**base)) for u in image_urls(r)]
    assert len(set(fresh)) == len(fresh) == 200  # no repeats without the ratio

    reqs = build_requests(RandomMMConfig(**base, repeat_image_ratio=0.5, repeat_pool_size=4))
    urls = [u for r in reqs for u in image_urls(r)]
    repeated = sum(r.num_repeated_images for r in reqs)
    assert 0.35 < repeated / len(urls) < 0.65
    # Repeats are byte-identical copies of the pool (the first 4 pictures); everything else is new.
    assert len(set(urls)) == len(urls) - repeated
    pool = list(dict.fromkeys(urls))[:4]
    assert sum(urls.count(p) - 1 for p in pool) == repeated

    every = build_requests(RandomMMConfig(**base, repeat_image_ratio=1.0, repeat_pool_size=1))
    assert len({u for r in every for u in image_urls(r)}) == 1


def test_lengths_fixed_and_in_range():
    fixed = build_requests(RandomMMConfig(num_prompts=10, input_len=12, output_len=7, images_per_request=0))
    assert all(r.num_words == 12 == len(text_of(r).split()) and r.max_tokens == 7 for r in fixed)

    varied = build_requests(RandomMMConfig(num_prompts=60, input_len=20, output_len=10, range_ratio=0.5,
                                           images_per_request=0))
    words = [len(text_of(r).split()) for r in varied]
    outs = [r.max_tokens for r in varied]
    assert words == [r.num_words for r in varied]
    assert all(10 <= w <= 30 for w in words) and len(set(words)) > 5
    assert all(5 <= o <= 15 for o in outs) and len(set(outs)) > 3


def test_parse_image_sizes_and_validation():
    assert parse_image_sizes("224x224, 448X336") == [(224, 224), (448, 336)]
    with pytest.raises(ValueError):
        parse_image_sizes("448")
    with pytest.raises(ValueError):
        build_requests(RandomMMConfig(range_ratio=1.5))


def audio_parts(req) -> list[dict]:
    return [p["input_audio"] for p in req.messages[0]["content"] if p["type"] == "input_audio"]


def test_audio_clips():
    """input_audio parts of synthetic WAV at the asked rate and lengths, after the pictures and before the text;
    counts in range, repeats byte-identical, and what the server's decoder makes of them."""
    import wave

    from vlserve.media.audio import AudioLimits, load_audio

    reqs = build_requests(RandomMMConfig(num_prompts=30, input_len=3, output_len=2, image_sizes=[(8, 8)],
                                         audios_per_request=0, max_audios_per_request=2, audio_seconds=[0.5, 1.25],
                                         audio_sample_rate=22050, repeat_audio_ratio=0.3, repeat_pool_size=2))
    assert {r.num_audios for r in reqs} == {0, 1, 2}
    seen, datas = set(), []
    for r in reqs:
        kinds = [p["type"] for p in r.messages[0]["content"]]
        assert kinds == ["image_url"] + ["input_audio"] * r.num_audios + ["text"]
        clips = audio_parts(r)
        total = 0.0
        for clip in clips:
            assert clip["format"] == "wav"
            data = base64.b64decode(clip["data"])
            datas.append(clip["data"])
            with wave.open(io.BytesIO(data)) as w:
                assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
                seconds = w.getnframes() / 22050
            seen.add(round(seconds, 3))
            total += seconds
        assert r.audio_seconds == pytest.approx(total, abs=1e-3)
    assert seen == {0.5, 1.25}
    assert len(set(datas)) < len(datas)  # some clips came from the pool
    audio = load_audio(base64.b64decode(datas[0]), AudioLimits())
    assert audio.source_rate == 22050 and np.abs(audio.waveform).max() > 0.05


def test_audio_options_change_nothing_else():
    base = dict(num_prompts=8, input_len=5, output_len=3, image_sizes=[(8, 8)], range_ratio=0.4)
    a = build_requests(RandomMMConfig(**base))
    b = build_requests(RandomMMConfig(**base, audio_seconds=[9.0], audio_sample_rate=8000))
    assert [r.messages for r in a] == [r.messages for r in b] and all(r.num_audios == 0 for r in a)
    assert parse_audio_seconds("2, 10,30") == [2.0, 10.0, 30.0]
    for bad in ("x", "0", "-1", ""):
        with pytest.raises(ValueError):
            parse_audio_seconds(bad)
    with pytest.raises(ValueError):
        build_requests(RandomMMConfig(audios_per_request=2, max_audios_per_request=1))


# --------------------------------------------------------------------------------------------- metrics


def rec(ttft, latency, tokens, itl=(), prompt=10, ok=True, start=0.0):
    return RequestRecord(success=ok, error="" if ok else "HTTP 500", send_time=start, end_time=start + latency,
                         ttft=ttft, itl=list(itl), latency=latency, prompt_tokens=prompt, completion_tokens=tokens)


def test_metrics_on_hand_made_records():
    records = [
        rec(0.1, 1.1, 11, itl=[0.1] * 10, start=0.0),  # TPOT (1.1-0.1)/10 = 100 ms
        rec(0.2, 0.5, 4, itl=[0.1, 0.1, 0.1], start=0.5),  # TPOT 100 ms
        rec(0.3, 0.3, 1, start=2.0),  # one token: no TPOT
        rec(0.4, 2.4, 5, itl=[0.5] * 4, start=2.0),  # TPOT 500 ms
        rec(9.0, 99.0, 1000, itl=[50.0], prompt=1000, ok=False, start=0.0),  # failed: ignored for stats
    ]
    m = compute_metrics(records, duration_s=2.0, percentiles=(50, 90))
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["total_output_tokens"] == 21 and m["total_input_tokens"] == 40
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(10.5)
    assert m["total_token_throughput"] == pytest.approx(30.5)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0) == m["p50_ttft_ms"]
    assert m["p90_ttft_ms"] == pytest.approx(370.0)  # linear interpolation between 300 and 400
    assert m["mean_tpot_ms"] == pytest.approx(700.0 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx((1.0 + 0.3 + 2.0) / 17 * 1000)
    assert m["mean_e2el_ms"] == pytest.approx(1075.0)
    assert m["max_concurrent_requests"] == 3  # the failed one spans everything
    assert "p99_ttft_ms" not in m
    table = format_table(m, (50, 90))
    assert "P90 TTFT (ms):" in table and "370.00" in table


def test_metrics_known_percentiles():
    records = [rec(i / 1000, i / 100, 2, itl=[i / 1000], start=i) for i in range(1, 101)]
    m = compute_metrics(records, duration_s=10.0, percentiles=(50, 90, 99))
    assert m["p50_ttft_ms"] == pytest.approx(50.5)
    assert m["p90_ttft_ms"] == pytest.approx(90.1)
    assert m["p99_ttft_ms"] == pytest.approx(99.01)
    assert m["p99_itl_ms"] == pytest.approx(99.01)
    assert m["p50_e2el_ms"] == pytest.approx(505.0)
    assert m["max_concurrent_requests"] == 1


def test_metrics_all_failed():
    m = compute_metrics([rec(None, 0.1, 0, ok=False)], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    assert "-" in format_table(m, (50, 90, 99))


# --------------------------------------------------------------------------------------------- end to end

CHUNK_SLEEP = 0.002


def fake_app(state: dict) -> FastAPI:
    """Streams `max_tokens` one-token chunks. Of every 5 arrivals, #1 gets HTTP 500 and #3 an error event."""
    app = FastAPI()
    lock = threading.Lock()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}, {"id": "other"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        with lock:
            idx = state["count"]
            state["count"] += 1
            state["bodies"].append({k: v for k, v in body.items() if k != "messages"})
            state["images"].append(sum(p["type"] == "image_url" for p in body["messages"][0]["content"]))
            state["audios"].append(sum(p["type"] == "input_audio" for p in body["messages"][0]["content"]))
            state["auth"].add(request.headers.get("authorization"))
        if idx % 5 == 1:
            return JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500)
        n = body["max_tokens"]

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def gen():
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(CHUNK_SLEEP)
                if idx % 5 == 3 and i == 2:
                    yield sse({"error": {"message": "engine died", "code": 500}})
                    return
                yield sse({"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]})
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if body["model"] != "no-usage":
                yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                                                    "prompt_tokens_details": {"cached_tokens": 3}}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture()
def fake_server():
    state = {"count": 0, "bodies": [], "images": [], "audios": [], "auth": set()}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def test_end_to_end_against_fake_server(fake_server, tmp_path, capsys):
    url, state = fake_server
    out = tmp_path / "res" / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "10", "--input-len", "8",
               "--output-len", "5", "--image-sizes", "16x16,32x32", "--images-per-request", "2",
               "--max-concurrency", "2", "--percentiles", "50,99", "--result-file", str(out),
               "--disable-tqdm", "--api-key", "sk-test"])
    assert rc == 0
    res = json.loads(out.read_text())
    m = res["metrics"]
    assert m["completed"] == 6 and m["failed"] == 4
    assert m["total_output_tokens"] == 30 and m["total_input_tokens"] == 42
    assert m["total_cached_input_tokens"] == 18
    assert 1 <= m["max_concurrent_requests"] <= 2
    # tokens came apart in time (a busy machine may read the first ones late: no bound from the server's sleeps)
    assert m["median_tpot_ms"] > 0 and m["p99_ttft_ms"] is not None
    assert res["config"]["model"] == "fake-model" and "api_key" not in res["config"]
    assert res["config"]["request_rate"] == "inf"
    assert sorted(res["errors"].values()) == [2, 2]
    assert any(e.startswith("HTTP 500") for e in res["errors"])
    assert "stream error: engine died" in res["errors"]
    ok = [r for r in res["requests"] if r["success"]]
    assert len(ok) == 6 and all(r["output_tokens"] == 5 and r["num_chunks"] == 5 for r in ok)
    assert all(r["ttft_ms"] > 0 and r["e2el_ms"] >= r["ttft_ms"] for r in ok)
    # What the server saw: streamed, usage asked for, ignore_eos on by default, both pictures sent.
    assert state["count"] == 10 and state["images"] == [2] * 10 and state["auth"] == {"Bearer sk-test"}
    for b in state["bodies"]:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["max_tokens"] == 5 and b["temperature"] == 0.0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "P99 ITL (ms):" in printed and "engine died" in printed


def test_end_to_end_rate_limited_without_usage_chunk(fake_server, tmp_path):
    url, state = fake_server
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--model", "no-usage", "--num-prompts", "5",
               "--input-len", "4", "--output-len", "3", "--images-per-request", "0", "--request-rate", "100",
               "--no-ignore-eos", "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    m = json.loads(out.read_text())["metrics"]
    # Arrivals 1 and 3 fail; the rest count their content chunks since no usage chunk came.
    assert m["completed"] == 3 and m["failed"] == 2 and m["total_output_tokens"] == 9
    assert m["total_input_tokens"] == 0 and m["total_cached_input_tokens"] == 0
    assert all("ignore_eos" not in b and b["model"] == "no-usage" for b in state["bodies"])
    assert state["auth"] == {None}  # no --api-key: no Authorization header


def test_server_down_exits_nonzero(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    common = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
              "--images-per-request", "0", "--disable-tqdm", "--timeout", "5"]
    assert main(common) == 1  # GET /v1/models fails
    out = tmp_path / "down.json"
    assert main(common + ["--model", "m", "--result-file", str(out)]) == 1  # every request fails
    res = json.loads(out.read_text())
    assert res["metrics"]["completed"] == 0 and res["metrics"]["failed"] == 2
    assert all(r["error"].startswith("ConnectError") for r in res["requests"])


def test_end_to_end_with_audio_clips(fake_server, tmp_path):
    url, state = fake_server
    out = tmp_path / "audio.json"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--input-len", "3", "--output-len", "2",
               "--images-per-request", "0", "--audios-per-request", "1-2", "--audio-seconds", "0.25,0.5",
               "--audio-sample-rate", "44100", "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert sorted(state["audios"]) == sorted(r["num_audios"] for r in res["requests"])
    assert set(state["audios"]) <= {1, 2} and len(state["audios"]) == 4
    assert res["config"]["dataset"]["audio_sample_rate"] == 44100
    assert res["config"]["dataset"]["audio_seconds"] == [0.25, 0.5]
