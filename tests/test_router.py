"""`vlserve router` in front of two `vlserve serve --registry` replicas (embedded bootstrap registry, KV events on):
a conversation with a picture keeps landing on the replica that cached it (its prefix-cache hits grow, the other
one's queries do not), the answers equal a replica's asked directly, a LoRA adapter's requests go to the replica
serving it, streaming passes through, and a killed replica is avoided while every request is still answered."""

from __future__ import annotations

import time

import openai
import pytest

from tests.conftest import noise_image
from tests.lora_utils import make_peft_adapter
from tests.server_utils import HTTP, RoleProcess, free_port, scrape
from tests.test_disagg import data_url

N_TOKENS = 6
SYSTEM = "You are a careful assistant who describes pictures in detail. " * 4


def _prefix(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name)


class Deployment:
    def __init__(self, ckpt, adapter=None):
        """`adapter`: a LoRA adapter folder replica r1 serves as "docs" (r0 serves none)."""
        bport = free_port()
        self.registry = f"http://127.0.0.1:{bport}"
        common = ["--heartbeat-interval", "0.3"]
        self.boot = RoleProcess("bootstrap", ["bootstrap", "--port", str(bport), *common,
                                              "--heartbeat-failure-threshold", "5"], f"{self.registry}/health")
        self.replicas: dict[str, RoleProcess] = {}
        self.urls: dict[str, str] = {}
        for name in ("r0", "r1"):
            port = free_port()
            self.urls[name] = f"http://127.0.0.1:{port}"
            self.replicas[name] = RoleProcess(name, [
                "serve", "--model", str(ckpt), "--port", str(port), "--registry", self.registry,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--max-model-len", "1024", *common,
                *(["--enable-lora", "--lora-modules", f"docs={adapter}"] if adapter and name == "r1" else [])],
                f"{self.urls[name]}/health")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.router = RoleProcess("router", ["router", "--model", str(ckpt), "--port", str(port), "--bootstrap",
                                             f"127.0.0.1:{bport}", "--allow-unsigned-replicas", *common],
                                  f"{self.url}/ready")
        self.procs = [self.boot, *self.replicas.values(), self.router]
        try:
            for p in self.procs:
                p.wait_healthy()
            self.wait_warm()
        except BaseException:
            self.close()
            raise

    def wait_warm(self, timeout: float = 30) -> None:
        """Both replicas known, answering and their event streams followed in order (not cold)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = scrape(f"{self.url}/metrics")
            if (m.get('vlserve:router_replicas{state="answering"}') == 2
                    and m.get('vlserve:router_replicas{state="cache_cold"}') == 0):
                return
            time.sleep(0.2)
        raise RuntimeError(f"router not warm: {m}\n{self.router.read_log()}")

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(url or self.url) + "/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.close()


@pytest.fixture(scope="module")
def deployment(tiny_ckpt, tmp_path_factory):
    ckpt = tiny_ckpt("qwen2_vl")
    d = Deployment(ckpt, make_peft_adapter(ckpt, tmp_path_factory.mktemp("lora") / "docs", targets="both"))
    yield d
    d.close()


def ask(client, messages, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          max_tokens=N_TOKENS, temperature=0,
                                          extra_body={"min_tokens": N_TOKENS}, **kw)


def picture_turn(seed: int, question: str) -> list[dict]:
    img = data_url(noise_image(224, 224, seed))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}},
                                         {"type": "text", "text": question}]}]


def test_a_conversation_with_a_picture_stays_on_the_replica_that_cached_it(deployment):
    d = deployment
    client = d.client()
    messages = picture_turn(7, "What is in this picture?")
    landed = []
    for turn, question in enumerate(["And the colours?", "Anything else?", "Thanks. Summarise."]):
        before = {n: scrape(f"{u}/metrics") for n, u in d.urls.items()}
        resp = ask(client, messages)
        after = {n: scrape(f"{u}/metrics") for n, u in d.urls.items()}
        grew = [n for n in d.urls if _prefix(after[n], "vlserve:prefix_cache_queries_total")
                > _prefix(before[n], "vlserve:prefix_cache_queries_total")]
        assert len(grew) == 1, grew
        landed.append(grew[0])
        if turn:
            hits = (_prefix(after[grew[0]], "vlserve:prefix_cache_hits_total")
                    - _prefix(before[grew[0]], "vlserve:prefix_cache_hits_total"))
            assert hits >= 16 and resp.usage.prompt_tokens_details.cached_tokens >= 16
        messages = [*messages, {"role": "assistant", "content": resp.choices[0].message.content},
                    {"role": "user", "content": question}]
        time.sleep(0.2)  # the replica's events reach the router
    assert len(set(landed)) == 1, landed
    routed = scrape(f"{d.url}/metrics")
    assert sum(v for k, v in routed.items() if k.startswith("vlserve:router_requests_total")
               and 'decision="cache-hit"' in k) >= 2
    # Greedy answers equal a replica's asked directly (the other one, which never saw this conversation).
    other = next(n for n in d.urls if n != landed[0])
    via_router = ask(client, messages).choices[0].message.content
    assert via_router == ask(d.client(d.urls[other]), messages).choices[0].message.content


def test_a_lora_adapter_goes_only_to_the_replica_serving_it(deployment):
    """r1 serves adapter "docs": the router lists it, sends its requests to r1 only (whose answers they are), and
    answers 404 for a name no replica serves."""
    router = deployment.client()
    deadline = time.monotonic() + 10
    while "docs" not in [m.id for m in router.models.list().data]:  # listed once the router scraped r1
        assert time.monotonic() < deadline, "the router never listed r1's adapter"
        time.sleep(0.2)
    before = {name: _prefix(scrape(f"{url}/metrics"), "vlserve:prompt_tokens_total")
              for name, url in deployment.urls.items()}
    direct = deployment.client(deployment.urls["r1"])
    for seed in range(4):
        turn = picture_turn(40 + seed, "What is in it?")
        want = direct.chat.completions.create(model="docs", messages=turn, max_tokens=N_TOKENS, temperature=0)
        got = router.chat.completions.create(model="docs", messages=turn, max_tokens=N_TOKENS, temperature=0)
        assert got.model == "docs" and got.choices[0].message.content == want.choices[0].message.content
    after = {name: _prefix(scrape(f"{url}/metrics"), "vlserve:prompt_tokens_total")
             for name, url in deployment.urls.items()}
    assert after["r0"] == before["r0"] and after["r1"] > before["r1"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        router.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_streaming_passes_through(deployment):
    client = deployment.client()
    messages = picture_turn(11, "Describe it.")
    whole = ask(client, messages).choices[0].message.content
    chunks = list(ask(client, messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    # The Responses API through the router: the same answer (it is served by the chat path), routed by its prefix.
    items = [messages[0], {"role": "user", "content": [
        {"type": "input_image", "image_url": messages[1]["content"][0]["image_url"]["url"]},
        {"type": "input_text", "text": messages[1]["content"][1]["text"]}]}]
    answer = client.responses.create(model=client.models.list().data[0].id, input=items, temperature=0,
                                     max_output_tokens=N_TOKENS, extra_body={"min_tokens": N_TOKENS})
    assert answer.output_text == whole
    with client.responses.stream(model=client.models.list().data[0].id, input=items, temperature=0,
                                 max_output_tokens=N_TOKENS, extra_body={"min_tokens": N_TOKENS}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == whole
    r = HTTP.get(f"{deployment.url}/v1/models", timeout=10)
    assert r.status_code == 200 and r.json()["data"]
    bad = HTTP.post(f"{deployment.url}/v1/chat/completions", content=b"{not json", timeout=10,
                    headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    page = HTTP.get(f"{deployment.url}/", timeout=10)  # the playground, talking to the router's own /v1
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    config = HTTP.get(f"{deployment.url}/playground/config.json", timeout=10).json()
    assert config["limits"]["mm_per_prompt"]["image"] >= 1


def test_a_dead_replica_is_avoided(deployment):
    d = deployment
    client = d.client()
    messages = picture_turn(7, "What is in this picture?")  # cached on one replica by the first test
    ask(client, messages)
    time.sleep(0.3)
    before = {n: _prefix(scrape(f"{u}/metrics"), "vlserve:prefix_cache_queries_total") for n, u in d.urls.items()}
    ask(client, messages)
    after = {n: _prefix(scrape(f"{u}/metrics"), "vlserve:prefix_cache_queries_total") for n, u in d.urls.items()}
    holder = next(n for n in d.urls if after[n] > before[n])
    d.replicas[holder].kill()
    for i in range(4):  # the cached one first, then fresh ones: all answered by the survivor
        assert ask(client, messages if i == 0 else picture_turn(20 + i, "Hi")).choices[0].message.content
