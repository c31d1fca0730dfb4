"""`vlserve router` in front of E->PD language servers (one encoder, two language servers publishing KV events,
found in the cluster's bootstrap registry): a conversation with a picture keeps landing on the language server
that cached it, although the pictures are decoded and hashed by the encoder there and by the router here (the
hashes must agree), and the answers equal a language server's asked directly."""

from __future__ import annotations

import time

import pytest

from tests.server_utils import RoleProcess, free_port, scrape
from tests.test_disagg import SECRET, Cluster
from tests.test_router import _prefix, ask, picture_turn


@pytest.fixture(scope="module")
def cluster(tiny_ckpt):
    ckpt = tiny_ckpt("qwen2_vl")
    events = {name: ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"] for name in ("L0", "L1")}
    c = Cluster(ckpt, events)
    port = free_port()
    c.router_url = f"http://127.0.0.1:{port}"
    router = RoleProcess("router", ["router", "--model", str(ckpt), "--port", str(port), "--bootstrap",
                                    c.bootstrap_url, "--replica-role", "language", "--heartbeat-interval", "0.3"],
                         f"{c.router_url}/ready", env={"VLSERVE_DISAGG_SECRET": SECRET})
    c.procs.append(router)
    try:
        router.wait_healthy()
        deadline = time.monotonic() + 30
        while True:  # both language servers known, answering, and their event streams followed in order
            m = scrape(f"{c.router_url}/metrics")
            if (m.get('vlserve:router_replicas{state="answering"}') == 2
                    and m.get('vlserve:router_replicas{state="cache_cold"}') == 0):
                break
            assert time.monotonic() < deadline, f"router not warm: {m}\n{router.read_log()}"
            time.sleep(0.2)
        yield c
    finally:
        c.close()


def test_a_picture_chat_stays_on_the_language_server_that_cached_it(cluster):
    c = cluster
    import openai

    client = openai.OpenAI(base_url=f"{c.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    urls = {n: lang.health_url.replace("/health", "") for n, lang in c.languages.items()}
    messages = picture_turn(5, "What is in this picture?")
    landed = []
    for turn, question in enumerate(["And the colours?", "Anything else?", "Summarise."]):
        before = {n: scrape(f"{u}/metrics") for n, u in urls.items()}
        resp = ask(client, messages)
        after = {n: scrape(f"{u}/metrics") for n, u in urls.items()}
        grew = [n for n in urls if _prefix(after[n], "vlserve:prefix_cache_queries_total")
                > _prefix(before[n], "vlserve:prefix_cache_queries_total")]
        assert len(grew) == 1, grew
        landed.append(grew[0])
        if turn:  # the whole previous prompt, picture included, was cached where it went
            assert resp.usage.prompt_tokens_details.cached_tokens >= 64
        messages = [*messages, {"role": "assistant", "content": resp.choices[0].message.content},
                    {"role": "user", "content": question}]
        time.sleep(0.3)  # the language server's events reach the router
    assert len(set(landed)) == 1, landed
    routed = scrape(f"{c.router_url}/metrics")
    assert sum(v for k, v in routed.items() if k.startswith("vlserve:router_requests_total")
               and 'decision="cache-hit"' in k) >= 2
    other = next(n for n in urls if n != landed[0])
    assert ask(client, messages).choices[0].message.content == \
        ask(c.client(other), messages).choices[0].message.content
