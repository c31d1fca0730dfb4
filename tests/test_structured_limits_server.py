"""Costly constraints against `vlserve serve` (issue #25, items 2 and 5): slow grammars compile on their own
bounded pool while /health, pictures and other requests are served; past the pool and its queue a request gets
503 at once; a client that leaves frees its place; a huge choice list is refused at once; a grammar that
fails in the middle of an answer fails the request with the reason (500, or an error event in a stream)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import noise_image
from tests.server_utils import HTTP, RemoteServer
from tests.test_server_api import data_url, image_part, user
from tests.test_structured_limits import FAILS_MID_ANSWER, words

ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return str(tiny_ckpt("qwen2_vl"))


@pytest.fixture(scope="module")
def server(model):
    # One compile thread, one place in its queue, one media thread: the smallest pools show what waits on what.
    with RemoteServer(model, "--dtype", "float32", "--structured-outputs-threads", "1",
                      "--structured-outputs-max-queued", "1", "--structured-outputs-compile-timeout", "60",
                      "--media-threads", "1") as s:
        yield s


def slow_grammar(seed: int) -> dict:
    """A valid schema, within every limit, that takes seconds to compile: 15k required properties (600 KB; ~2.5 s
    on a quiet 2-core AMD EPYC, where 10k take ~1 s: too quick for the checks below)."""
    names = [f"p{seed}_{i}" for i in range(15_000)]
    return {"json": {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}}


def body(model: str, constraint: dict | None = None, **kw) -> dict:
    out = {"model": model, "messages": user("hi"), "max_tokens": 1, **kw}
    if constraint is not None:
        out["structured_outputs"] = constraint
    return out


def post_in_thread(server, payload: dict, timeout: float, results: list) -> threading.Thread:
    def run():
        try:
            results.append(HTTP.post(server.url + ROUTE, json=payload, timeout=timeout).status_code)
        except httpx.TimeoutException:
            results.append("left")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def compiles_in_flight(server) -> float:
    text = HTTP.get(server.url + "/metrics", timeout=5).text
    line = next(l for l in text.splitlines() if l.startswith("vlserve:structured_outputs_compiles_in_flight{"))
    return float(line.rsplit(" ", 1)[1])


def wait_for_compiles(server, done, timeout: float = 60.0) -> None:
    """Until the server's count of compiles in flight satisfies `done` (a busy machine may take a while to take
    the requests in: no fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not done(compiles_in_flight(server)):
        if time.monotonic() > deadline:
            raise AssertionError(f"compiles in flight stayed at {compiles_in_flight(server)}")
        time.sleep(0.05)


def still_compiling(threads: list[threading.Thread]) -> bool:
    return any(t.is_alive() for t in threads)


def test_slow_grammars_hold_up_neither_health_nor_pictures_and_the_rest_get_503(server, model):
    """Each answer below comes while the slow grammars are still compiling: none of them waited for a compile (no
    wall-clock bound: a busy machine stretches every step alike)."""
    results: list = []
    slow = [post_in_thread(server, body(model, slow_grammar(seed)), 120, results) for seed in range(2)]
    try:
        wait_for_compiles(server, lambda n: n == 2)  # both in: one compiles, one waits
        refused = server.post(ROUTE, json=body(model, slow_grammar(2)))
        assert refused.status_code == 503 and "--structured-outputs-max-queued" in refused.text, refused.text
        for _ in range(5):
            assert HTTP.get(server.url + "/health", timeout=5).status_code == 200
        picture = server.post(ROUTE, json=body(model, messages=user(image_part(data_url(noise_image(64, 48, 1))),
                                                                     "hi")))
        assert picture.status_code == 200, picture.text
        assert still_compiling(slow), "the grammars were all compiled already: the test shows nothing"
    finally:  # a failure above must not leave compiles running into the next test
        for t in slow:
            t.join(120)
    assert results == [200, 200]


def test_a_client_that_leaves_frees_its_place(server, model):
    results: list = []
    gone = [post_in_thread(server, body(model, slow_grammar(10 + seed)), 0.5, results) for seed in range(2)]
    for t in gone:
        t.join()
    assert results == ["left"] * 2
    # the server notices within its disconnect poll (0.5 s): the queued compile is dropped
    wait_for_compiles(server, lambda n: n <= 1)
    ok = server.post(ROUTE, json=body(model, {"choice": ["ok-after"]}, max_tokens=5))
    assert ok.status_code == 200, ok.text  # 503 if the abandoned compiles still held the queue
    assert ok.json()["choices"][0]["message"]["content"] == "ok-after"


def test_a_huge_choice_list_is_refused_at_once(server, model):
    """Refused by its count, before anything is compiled (the message names the count check)."""
    resp = server.post(ROUTE, json=body(model, {"choice": words(200_000, k=3)}))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("structured_outputs.choice has 200000 strings, over the "
                                                      "limit of 16384 (--structured-outputs-max-choices)")


def test_a_grammar_that_can_never_finish_is_a_400(server, model):
    resp = server.post(ROUTE, json=body(model, {"grammar": 'start: "a" start'}))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("structured_outputs.grammar can never be finished")
    resp = server.post(ROUTE, json=body(model, {"regex": "a{1000000}"}))
    assert resp.status_code == 400 and "--structured-outputs-max-min-length" in resp.text


def test_a_grammar_failing_mid_answer_is_an_error_with_the_reason(server, model):
    resp = server.post(ROUTE, json=body(model, {"grammar": FAILS_MID_ANSWER}, max_tokens=20))
    assert resp.status_code == 500, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("structured_outputs.grammar failed after 1 token(s) of output, in the grammar engine: ")
    with HTTP.stream("POST", server.url + ROUTE, json=body(model, {"grammar": FAILS_MID_ANSWER}, max_tokens=20,
                                                           stream=True), timeout=60) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "failed after 1 token(s) of output" in error["message"]
    ok = server.post(ROUTE, json=body(model, {"choice": ["fine"]}, max_tokens=5))
    assert ok.json()["choices"][0]["message"]["content"] == "fine"
