"""Encode/language disaggregation end to end, every role its own process on loopback, through the openai client.

1E+1L and 2E+1L token-identical to the aggregated engine (with every resume forced), only media rows on the wire,
prefix cache through pictures, an encoder killed mid-run, a restarted encoder rejoining, fault injection, a rogue
encoder without the secret kept out and an encoder answering nonsense retried elsewhere; every receive block
back and nothing held by the encoders at the end."""

from __future__ import annotations

import base64
import io
import json
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.conftest import noise_image
from tests.server_utils import RoleProcess, free_port, scrape
from vlserve import LLM, SamplingParams
from vlserve.disagg.transports import TRANSPORTS, unavailable_reason
from vlserve.disagg.transports.base import QUARANTINE_ENV

HB = "0.3"  # heartbeat interval; with a threshold of 10 a dead encoder is noticed within ~3 s
THRESHOLD = "10"  # tolerant enough that a loaded 2-core machine never drops a live encoder
N_TOKENS = 8
SECRET = "test-disagg-secret"


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def picture_chat(*seeds: int, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(noise_image(56 + 8 * (s % 4), 56, s))}} for s in seeds]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Cluster:
    """A bootstrap, encoder "A" (or the given `encoders`, name -> their own flags) and the given language servers,
    all with the same shared secret. With `prefills` (E->P->D): those prefill instances, and the "languages" are
    decode instances (but those `roles` names otherwise). With `registry` (a --registry URL, e.g. etcd://...) the
    roles meet there and no bootstrap is started."""

    def __init__(self, ckpt, languages: dict[str, list[str]], encoder_env: dict | None = None,
                 limits: str = "image=4", backend: str = "zmq", prefills: dict[str, list[str]] | None = None,
                 extra: tuple[str, ...] = (), encoders: dict[str, tuple[str, ...]] | None = None,
                 roles: dict[str, str] | None = None, registry: str | None = None):
        # A failed in-place transfer's blocks are held 6 s rather than 15 (a killed writer's test waits them out;
        # NIXL writes then give up after 4 s, far above what one takes here).
        # (PYTHONFAULTHANDLER: a role a test sends SIGABRT to prints where each of its threads stands)
        self.env = {"VLSERVE_DISAGG_SECRET": SECRET, QUARANTINE_ENV: "6", "PYTHONFAULTHANDLER": "1"}
        self.ckpt, self.encoder_env = ckpt, {**self.env, **(encoder_env or {})}
        self.backend = backend
        port = free_port()
        self.bootstrap_url = None if registry else f"127.0.0.1:{port}"
        self.procs: list[RoleProcess] = []
        self.encoders: dict[str, RoleProcess] = {}
        self.prefills: dict[str, RoleProcess] = {}
        self.languages: dict[str, RoleProcess] = {}
        self.role = "decode" if prefills else "language"
        try:
            if registry:  # an outside registry (etcd://...): the roles meet there, no bootstrap process
                meet = ["--registry", registry]
            else:
                meet = ["--bootstrap", self.bootstrap_url]
                self.procs.append(RoleProcess("bootstrap", ["bootstrap", "--port", str(port), "--heartbeat-interval",
                                                            HB, "--heartbeat-failure-threshold", THRESHOLD],
                                              f"http://{self.bootstrap_url}/health", env=self.env))
            self.common = ["--model", str(ckpt), "--dtype", "float32", "--limit-mm-per-prompt", limits, *meet,
                           "--heartbeat-interval", HB, "--transfer-backend", backend, *extra]
            for name, args in (encoders or {"A": ()}).items():
                self.start_encoder(name, wait=False, args=args)
            for name, args in (prefills or {}).items():
                self.start_prefill(name, args, wait=False)
            for name, args in languages.items():
                self.start_language(name, args, wait=False, role=(roles or {}).get(name))
            for p in self.procs:
                p.wait_healthy()
        except BaseException:
            self.close()
            raise

    def start_encoder(self, name: str, wait: bool = True, env: dict | None = None,
                      args: tuple[str, ...] = ()) -> RoleProcess:
        port = free_port()
        enc = RoleProcess(f"encoder-{name}", ["encode", *self.common, "--port", str(port), "--data-port",
                                              str(free_port()), *args], f"http://127.0.0.1:{port}/health",
                          env={**self.encoder_env, **(env or {})})
        enc.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.encoders[name] = enc
        self.procs.append(enc)
        return enc.wait_healthy() if wait else enc

    def start_language(self, name: str, args: list[str] = (), wait: bool = True,
                       role: str | None = None) -> RoleProcess:
        """A language server (or decode instance: the cluster's role unless `role` says)."""
        port, role = free_port(), role or self.role
        lang = RoleProcess(f"{role}-{name}", [role, *self.common, "--port", str(port), "--max-model-len", "2048",
                                              "--heartbeat-failure-threshold", THRESHOLD, *args],
                           f"http://127.0.0.1:{port}/health", env=self.env)
        lang.role = role
        self.languages[name] = lang
        self.procs.append(lang)
        return lang.wait_healthy() if wait else lang

    def start_prefill(self, name: str, args: list[str] = (), wait: bool = True,
                      env: dict | None = None) -> RoleProcess:
        port = free_port()
        pre = RoleProcess(f"prefill-{name}", ["prefill", *self.common, "--port", str(port), "--data-port",
                                              str(free_port()), "--max-model-len", "2048",
                                              "--heartbeat-failure-threshold", THRESHOLD, *args],
                          f"http://127.0.0.1:{port}/health", env={**self.env, **(env or {})})
        pre.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.prefills[name] = pre
        self.procs.append(pre)
        return pre.wait_healthy() if wait else pre

    def wait_prefills(self, lang: str, n: int, timeout: float = 30) -> None:
        wait_until(lambda: self.metrics(lang)["vlserve:prefill_instances_available"] == n,
                   f"{self.role} {lang} never saw {n} prefill instances", timeout)

    def client(self, lang: str) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.languages[lang].health_url.replace("/health", "/v1"), api_key="x",
                               max_retries=0, timeout=60)
        client.served_model = str(self.ckpt)
        return client

    def metrics(self, lang: str) -> dict[str, float]:
        return scrape(self.languages[lang].health_url.replace("/health", "/metrics"))

    def live_encoders(self) -> list[str]:
        return [name for name, enc in self.encoders.items() if enc.proc.poll() is None]

    def use_encoders(self, *names: str, envs: dict[str, dict] | None = None) -> None:
        """Exactly the encoders `names` running (a missing or dead one started, with its env from `envs`; any other
        stopped) and paired with every language server and prefill instance: the state a test on a shared cluster
        starts from, whatever ran before it."""
        for name in self.live_encoders():
            if name not in names:
                self.encoders[name].close()
        # First every stopped or dead encoder dropped (counted until then), then the new ones paired: never the
        # right count made of the wrong encoders.
        self.wait_paired_encoders(len(self.live_encoders()))
        if len(self.live_encoders()) < len(names):
            for name in names:
                if name not in self.live_encoders():
                    self.start_encoder(name, wait=False, env=(envs or {}).get(name))
            for name in names:
                self.encoders[name].wait_healthy()
            self.wait_paired_encoders(len(names))

    def wait_paired_encoders(self, n: int, timeout: float = 20) -> None:
        """Every running language server and prefill instance pairs with exactly n encoders."""
        urls = [p.health_url.replace("/health", "/metrics") for p in self.prefills.values() if p.proc.poll() is None]
        urls += [p.health_url.replace("/health", "/metrics") for p in self.languages.values()
                 if p.role == "language" and p.proc.poll() is None]
        for url in urls:
            wait_until(lambda url=url: scrape(url)["vlserve:encoders_available"] == n,
                       f"{url} never saw {n} encoders", timeout)

    def wait_encoders(self, lang: str, n: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.metrics(lang)["vlserve:encoders_available"] != n:
            assert time.monotonic() < deadline, f"language {lang} never saw {n} encoders"
            time.sleep(0.1)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.close()

    def close_quickly(self) -> None:
        """Like close, each kind of role at once: the servers, then their peers, then the bootstrap."""
        peers = [*self.encoders.values(), *self.prefills.values()]
        groups = [list(self.languages.values()), peers, [p for p in self.procs if p not in peers
                                                          and p not in self.languages.values()]]
        with ThreadPoolExecutor(8) as pool:
            for group in groups:
                list(pool.map(RoleProcess.close, group))


def wait_until(check, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def wait_language_blocks_free(fetch) -> None:
    def free():
        m = fetch()
        total = m['vlserve:embedding_buffer_total_blocks{role="language"}']
        return m['vlserve:embedding_buffer_free_blocks{role="language"}'] == total > 0
    wait_until(free, f"language receive blocks leaked: {fetch()}")


def wait_encoder_idle(url: str) -> None:
    wait_until(lambda: scrape(url)["vlserve:encode_transfers_held"] == 0, f"encoder still holds transfers: {url}")


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4})


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(unavailable_reason(b) is not None,
                                                     reason=str(unavailable_reason(b)))) for b in TRANSPORTS]
# The whole behaviour matrix runs over ZeroMQ; the other backends run only what they do themselves (their write
# path, resumes, a sender that dies mid-write): the tests marked EVERY_BACKEND. The cluster of each backend is
# started once and shared by those tests (a module fixture; the zmq one serves both kinds).
ZMQ_ONLY = [p for p in BACKENDS if p.values == ("zmq",)]
EVERY_BACKEND = pytest.mark.parametrize("cluster", BACKENDS, indirect=True)
os.environ.setdefault("UCX_TLS", "tcp")  # NIXL over plain TCP, as on machines without RDMA (roles inherit it)


@pytest.fixture(scope="module", params=ZMQ_ONLY)
def cluster(tiny_ckpt, request):
    """Bootstrap, encoder A, languages "main" and "small" over one transport (ZeroMQ unless a test asks for
    every backend: EVERY_BACKEND)."""
    small = ["--media-allocate-rows", "4", "--receive-block-rows", "4", "--media-buffer-blocks", "8"]  # 32 rows
    c = Cluster(tiny_ckpt("qwen2_vl"), {"main": [], "small": small}, backend=request.param)
    yield c
    c.close_quickly()


_EXPECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # offline LLM -> {messages: greedy answer}


def expected_text(offline: LLM, messages) -> str:
    """The aggregated engine's greedy answer, computed once per offline engine and chat: the same pictures are
    asked of every transport's cluster, and greedy decoding of one prompt is deterministic."""
    memo = _EXPECTED.setdefault(offline, {})
    key = json.dumps(messages, sort_keys=True)
    if key not in memo:
        params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
        memo[key] = offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    return memo[key]


def ask(client: openai.OpenAI, messages, **kw) -> str:
    resp = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=N_TOKENS,
                                          temperature=0, extra_body={"min_tokens": N_TOKENS}, **kw)
    return resp.choices[0].message.content


CASES = {"one image": picture_chat(1), "three images": picture_chat(2, 3, 4, text="Compare."),
         "text only": [{"role": "user", "content": "Just text, no pictures."}]}


@EVERY_BACKEND
@pytest.mark.parametrize("lang", ["main", "small"])
def test_1e1l_matches_aggregated_and_small_buffers_resume(cluster, offline, lang):
    cluster.use_encoders("A")
    before = cluster.metrics(lang)
    for name, messages in CASES.items():
        assert ask(cluster.client(lang), messages) == expected_text(offline, messages), name
    after = cluster.metrics(lang)
    resumes = 'vlserve:embedding_transfer_resumes_total{role="language"}'
    success = 'vlserve:embedding_transfers_total{role="language",state="success"}'
    assert after[success] - before[success] == 2  # text-only never touched an encoder
    assert (after[resumes] > before[resumes]) == (lang == "small")  # 4 rows never hold three pictures
    # The encoder's mm_hash reaches the block hashes: asking again hits the prefix cache through the picture.
    client = cluster.client(lang)
    resp = client.chat.completions.create(model=client.served_model, messages=CASES["one image"], max_tokens=1)

    def hits(m):
        return sum(v for k, v in m.items() if k.startswith("vlserve:prefix_cache_hits_total"))

    assert hits(cluster.metrics(lang)) - hits(after) == (resp.usage.prompt_tokens - 1) // 16 * 16  # all full blocks
    wait_language_blocks_free(lambda: cluster.metrics(lang))
    wait_encoder_idle(cluster.encoders["A"].metrics_url)


@EVERY_BACKEND
def test_only_media_rows_travel(cluster, offline):
    """Per request: 8 + 24 bytes per token (fill id, positions) plus one embedding row per media token only."""
    cluster.use_encoders("A")
    messages = picture_chat(7, 8, text="Two pictures and some text around them, quite a few words of it.")
    before = cluster.metrics("main")
    resp = cluster.client("main").chat.completions.create(model=str(cluster.ckpt), messages=messages, max_tokens=1)
    moved = cluster.metrics("main")['vlserve:embedding_transfer_bytes_total{role="language"}'] - \
        before['vlserve:embedding_transfer_bytes_total{role="language"}']
    media_tokens = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids.count(
        offline.config.model.image_token_id)
    hidden = offline.config.model.text.hidden_size
    assert moved == resp.usage.prompt_tokens * (8 + 24) + media_tokens * hidden * 4  # float32 rows


def test_a_request_refused_after_its_picture_was_encoded_gives_its_blocks_back(cluster):
    """The rows have landed in this server's receive blocks when max_tokens turns out not to fit: a 400, and the
    prepared prompt's owner frees the blocks (nothing in the server frees them by hand)."""
    cluster.use_encoders("A")
    client = cluster.client("main")
    before = cluster.metrics("main")['vlserve:embedding_transfers_total{role="language",state="success"}']
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=client.served_model, messages=picture_chat(9), max_tokens=2048)
    assert cluster.metrics("main")['vlserve:embedding_transfers_total{role="language",state="success"}'] > before
    wait_language_blocks_free(lambda: cluster.metrics("main"))


def test_a_long_text_with_a_small_picture_reserves_the_pictures_rows_only(cluster, offline):
    """Receive blocks hold media rows only: ~1200 text tokens beside a 4-token picture take one 16-row block
    while the request runs (a row per token before), and a language server whose whole pool is 32 rows serves
    them; the answers are the aggregated ones."""
    cluster.use_encoders("A")
    messages = picture_chat(1, text="Describe it. " + "word " * 400)
    client, n = cluster.client("main"), 512  # long enough to be running when its first token arrives
    params = {"max_tokens": n, "temperature": 0, "extra_body": {"min_tokens": n}}
    stream = client.chat.completions.create(model=client.served_model, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **params)
    text, held, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        text.append(chunk.choices[0].delta.content or "")
        if held is None and text[-1]:  # the request runs: its picture's rows are in the blocks
            m = cluster.metrics("main")
            held = (m['vlserve:embedding_buffer_total_blocks{role="language"}']
                    - m['vlserve:embedding_buffer_free_blocks{role="language"}'])
    assert usage.prompt_tokens > 1000 and held == 1, (usage, held)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=n, min_tokens=n), use_tqdm=False)
    assert "".join(text) == want[0].outputs[0].text
    assert ask(cluster.client("small"), messages) == expected_text(offline, messages)
    for lang in ("main", "small"):
        wait_language_blocks_free(lambda: cluster.metrics(lang))


@EVERY_BACKEND
def test_2e1l_spreads_work_over_both_encoders(cluster, offline):
    cluster.use_encoders("A", "B")
    chats = [picture_chat(100 + i) for i in range(10)]
    with ThreadPoolExecutor(5) as pool:
        got = list(pool.map(lambda m: ask(cluster.client("main"), m), chats))
    assert got == [expected_text(offline, m) for m in chats]
    for name in ("A", "B"):
        m = scrape(cluster.encoders[name].metrics_url)
        assert m['vlserve:embedding_transfers_total{role="encode",state="success"}'] > 0, f"encoder {name} idle"
        wait_encoder_idle(cluster.encoders[name].metrics_url)


@EVERY_BACKEND
def test_encoder_killed_mid_run_gives_retries_or_clean_errors(cluster, offline):
    cluster.use_encoders("A", "B")  # B is killed: the next test that wants it starts a new one
    chats = [picture_chat(200 + i, text="Again?") for i in range(12)]

    def one(messages):
        try:
            return ask(cluster.client("main"), messages)
        except openai.APIStatusError as e:
            assert e.status_code == 503, e
            return e

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, m) for m in chats]
        time.sleep(0.15)
        cluster.encoders["B"].kill()
        results = [f.result(timeout=60) for f in futures]
    for messages, got in zip(chats, results):
        assert isinstance(got, Exception) or got == expected_text(offline, messages)
    cluster.wait_encoders("main", 1)
    wait_language_blocks_free(lambda: cluster.metrics("main"))
    assert ask(cluster.client("main"), CASES["one image"]) == expected_text(offline, CASES["one image"])


def test_restarted_encoder_rejoins_through_the_bootstrap(cluster, offline):
    cluster.use_encoders("A")  # what the killed encoder left (any other encoder stopped)
    restarted = cluster.start_encoder("B2")
    cluster.wait_encoders("main", 2)
    # Pictures go to encoders by rendezvous hashing on random instance ids, so any 8 of them all prefer the old
    # encoder once in 256 runs: send rounds of 8 until the restarted one has had work (5 rounds: 1 in 10^12).
    served = 'vlserve:embedding_transfers_total{role="encode",state="success"}'
    for round_ in range(5):
        chats = [picture_chat(300 + 8 * round_ + i) for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda m: ask(cluster.client("main"), m), chats))
        assert got == [expected_text(offline, m) for m in chats]
        if scrape(restarted.metrics_url)[served] > 0:
            break
    assert scrape(restarted.metrics_url)[served] > 0


def test_encoder_without_the_secret_cannot_join(cluster):
    paired = cluster.live_encoders()  # whatever runs (A and B2 after the test before), all paired
    cluster.use_encoders(*paired)
    rogue = cluster.start_encoder("rogue", wait=False, env={"VLSERVE_DISAGG_SECRET": "a guess"})
    assert rogue.proc.wait(60) != 0  # the registry refuses it, so it gives up
    assert "401" in rogue.read_log()
    assert cluster.metrics("main")["vlserve:encoders_available"] == len(paired)


def test_fault_injection_each_request_correct_or_clean_error(cluster, offline):
    """Over ZeroMQ only (injected before anything is written: the same for every backend). The only encoder is
    one that fails 30 % of its transfers on purpose: no other to retry on; a later test gets A back."""
    cluster.use_encoders("F", envs={"F": {"VLSERVE_TRANSFER_FAILURE_PROB": "0.3"}})
    ok = failed = 0
    for i in range(24):  # P(no injected failure) = 0.7^24 < 0.02 %
        messages = picture_chat(400 + i % 7)
        try:
            assert ask(cluster.client("main"), messages) == expected_text(offline, messages)
            ok += 1
        except openai.APIStatusError as e:
            assert e.status_code == 503 and "injected" in str(e), e
            failed += 1
    assert ok and failed, (ok, failed)
    wait_language_blocks_free(lambda: cluster.metrics("main"))
    wait_encoder_idle(cluster.encoders["F"].metrics_url)
