"""LoRA adapters in E->PD and E->P->D, each role its own process. A chat with a picture by adapter name (an adapter
of the vision tower, of the language model, of both) and the base model each give the aggregated offline engine's
greedy fp32 answer: the encoder runs the tower adapter, the language server (or the prefill and decode instances)
the LM one. An encoder started without --enable-lora refuses a tower adapter with a 503 naming itself and why: the
language server tries another encoder, or answers that 503 when none can; adapters of the LM alone never need
the encoder's support. A prefill instance without --enable-lora refuses every adapter the same way, and the decode
instance tries another. Nothing leaks."""

from __future__ import annotations

import openai
import pytest

from tests.lora_utils import make_adapters
from tests.server_utils import scrape
from tests.test_disagg import Cluster, picture_chat, wait_encoder_idle, wait_language_blocks_free, wait_until
from tests.test_lora_server import chat_prompt
from tests.test_pd_disagg import decode_holds_nothing
from vlserve import LLM, LoRARequest, SamplingParams

N_TOKENS = 8
MAX_RANK = 8
LORA = ("--enable-lora", "--max-lora-rank", str(MAX_RANK))
ADAPTERS = ("tower", "lm", "both")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    return make_adapters(ckpt, tmp_path_factory.mktemp("adapters"),
                         {name: (name, i + 1) for i, name in enumerate(ADAPTERS)})


@pytest.fixture(scope="module")
def cluster(ckpt, adapters):
    """Bootstrap, encoder "A" (--enable-lora), language server "main" serving the three adapters (E->PD), and
    decode instance "decode" serving them too with prefill instances "P" (--enable-lora) and "Q" (without it)
    (E->P->D, the same encoders). Every role applying adapters is started with the same --lora-modules."""
    modules = ("--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))
    serving = [*LORA, "--max-loras", "2", *modules]
    c = Cluster(ckpt, {"main": serving, "decode": serving}, encoders={"A": (*LORA, *modules)},
                prefills={"P": [*LORA, *modules], "Q": []}, roles={"main": "language"})
    yield c
    c.close_quickly()


@pytest.fixture(scope="module")
def offline(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4}, enable_lora=True,
              max_lora_rank=MAX_RANK, max_loras=2)
    yield llm
    llm.shutdown()


def ask(cluster: Cluster, messages, model: str, server: str = "main") -> str:
    resp = cluster.client(server).chat.completions.create(
        model=model, messages=messages, max_tokens=N_TOKENS, temperature=0, extra_body={"min_tokens": N_TOKENS})
    assert resp.model == model
    return resp.choices[0].message.content


def expected(offline: LLM, adapters, messages, name: str | None) -> str:
    lora = None if name is None else LoRARequest(name, 1 + ADAPTERS.index(name), str(adapters[name]))
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    return offline.generate(chat_prompt(offline, messages), params, use_tqdm=False,
                            lora_request=lora)[0].outputs[0].text


def assert_nothing_held(cluster: Cluster) -> None:
    wait_language_blocks_free(lambda: cluster.metrics("main"))
    for name in cluster.live_encoders():
        wait_encoder_idle(cluster.encoders[name].metrics_url)

    wait_until(lambda: decode_holds_nothing(cluster.metrics("decode"), cluster.ckpt), "decode KV blocks leaked")
    for name, pre in cluster.prefills.items():
        if pre.proc.poll() is None:
            wait_until(lambda pre=pre: scrape(pre.metrics_url)["vlserve:prefill_transfers_held"] == 0
                       and scrape(pre.metrics_url)["vlserve:prefill_requests_in_flight"] == 0,
                       f"prefill {name} still holds transfers")


def test_each_adapter_and_the_base_model_match_the_aggregated_engine(cluster, offline, adapters, ckpt):
    messages = picture_chat(1)
    base = expected(offline, adapters, messages, None)
    assert ask(cluster, messages, str(ckpt)) == base
    for name in ADAPTERS:
        want = expected(offline, adapters, messages, name)
        assert want != base, name  # each adapter changes the answer: the comparison below means something
        assert ask(cluster, messages, name) == want, name
    # the encoder cache keeps each adapter's picture apart: asked again, in another order, the same answers
    for name in reversed(ADAPTERS):
        assert ask(cluster, messages, name) == expected(offline, adapters, messages, name), name
    assert ask(cluster, messages, str(ckpt)) == base
    assert_nothing_held(cluster)


def test_e_p_d_each_adapter_and_the_base_model_match_the_aggregated_engine(cluster, offline, adapters, ckpt):
    """The decode instance sends each request's adapter to a prefill instance: every answer is the adapter's
    whichever instance it tries first (Q, without --enable-lora, refuses and the request is retried on P; that
    Q refuses is shown by the next test, with Q alone)."""
    cluster.use_encoders("A")
    cluster.wait_prefills("decode", 2)
    chats = [picture_chat(11), picture_chat(12, 13, text="Compare."),
             [{"role": "user", "content": "Just text, no pictures."}]]
    for messages in chats:
        base = expected(offline, adapters, messages, None)
        assert ask(cluster, messages, str(ckpt), "decode") == base
        for name in ADAPTERS:
            want = expected(offline, adapters, messages, name)
            # each adapter changes the answer, a tower adapter through the pictures only: the check means something
            assert (want != base) == (name != "tower" or messages is not chats[-1]), name
            assert ask(cluster, messages, name, "decode") == want, name
    # the prefix caches keep adapters apart: the same prompts again, adapters in another order
    messages = chats[0]
    for name in reversed(ADAPTERS):
        assert ask(cluster, messages, name, "decode") == expected(offline, adapters, messages, name), name
    assert ask(cluster, messages, str(ckpt), "decode") == expected(offline, adapters, messages, None)
    assert_nothing_held(cluster)


def test_a_prefill_instance_without_lora_refuses_adapters_with_a_503_naming_itself(cluster, offline, adapters,
                                                                                    ckpt):
    """Stops P (no later test uses the prefill instances)."""
    cluster.use_encoders("A")
    cluster.prefills["P"].close()
    cluster.wait_prefills("decode", 1)
    messages = picture_chat(14)
    for name in ("lm", "tower"):
        with pytest.raises(openai.APIStatusError) as e:
            ask(cluster, messages, name, "decode")
        message = e.value.response.json()["error"]["message"]
        assert e.value.status_code == 503, message
        assert f"cannot apply LoRA adapter {name!r}" in message and "--enable-lora" in message, message
    assert ask(cluster, messages, str(ckpt), "decode") == expected(offline, adapters, messages, None)
    assert_nothing_held(cluster)


def test_an_encoder_without_lora_refuses_tower_adapters_and_the_cluster_serves_on(cluster, offline, adapters,
                                                                                  ckpt):
    cluster.use_encoders("A", "B")  # B: no --enable-lora
    # a tower adapter sent to B is refused there and retried on A: every answer right (which encoder a request
    # tries first is the language server's choice, so B's refusal itself is checked below, with B alone)
    for seed in range(2, 6):
        messages = picture_chat(seed)
        assert ask(cluster, messages, "tower") == expected(offline, adapters, messages, "tower"), seed
    cluster.use_encoders("B")
    messages = picture_chat(7)
    with pytest.raises(openai.APIStatusError) as e:
        ask(cluster, messages, "both")
    message = e.value.response.json()["error"]["message"]
    assert e.value.status_code == 503, message
    assert "cannot apply LoRA adapter 'both'" in message and "--enable-lora" in message, message
    # an LM adapter and the base model never need the encoder's adapters
    assert ask(cluster, messages, "lm") == expected(offline, adapters, messages, "lm")
    assert ask(cluster, messages, str(ckpt)) == expected(offline, adapters, messages, None)
    assert_nothing_held(cluster)
    enc = scrape(cluster.encoders["B"].metrics_url)
    assert enc["vlserve:encode_requests_in_flight"] == 0
    wait_until(lambda: cluster.metrics("main")["vlserve:encoders_available"] == 1, "B unpaired")


# ---- options --------------------------------------------------------------------------------------------------
def test_serve_disagg_passes_the_lora_options_to_every_role_that_applies_them(ckpt):
    from tests.test_cli import _flags, _subparser
    from vlserve.core.config import Options
    from vlserve.disagg.launcher import plan_children

    for role in ("prefill", "decode"):
        assert {"--enable-lora", "--max-loras", "--max-lora-rank"} <= _flags(_subparser(role)), role
    for role in ("encode", "prefill", "decode", "language"):  # each applies only the adapters it was started with
        assert "--lora-modules" in _flags(_subparser(role)), role
    assert "--lora-dir" in _flags(_subparser("decode")) and "--lora-dir" not in _flags(_subparser("prefill"))
    for num_prefill, api in ((0, "language"), (1, "decode-0")):  # E->PD, E->P->D
        opts = Options()
        opts.engine.model, opts.engine.enable_lora, opts.engine.max_lora_rank = "/m", True, 32
        opts.engine.lora_modules, opts.server.allow_runtime_lora = ("a=/adapters/a",), True
        opts.server.lora_dir = ("/adapters",)
        opts.disagg.num_prefill = opts.disagg.num_decode = num_prefill
        argv = {c.name: c.argv for c in plan_children(opts, "INFO")}
        appliers = ["encoder-0", api] + (["prefill-0"] if num_prefill else [])
        for name in appliers:
            assert "--enable-lora" in argv[name] and argv[name][argv[name].index("--max-lora-rank") + 1] == "32", name
        assert "--allow-runtime-lora" in argv[api] and "--lora-dir" in argv[api]
        for name in appliers:
            assert argv[name][argv[name].index("--lora-modules") + 1] == "a=/adapters/a", name
        for name in set(appliers) - {api}:
            assert "--allow-runtime-lora" not in argv[name] and "--lora-dir" not in argv[name], name
