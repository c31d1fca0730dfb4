"""E->P->D: an encoder feeds a prefill instance, whose prompt KV and first token move to a decode instance over
every transport; through the official client the decode instance answers exactly as the aggregated engine does
(pictures and text, greedy and seeded, streamed, long prompts resumed into more blocks). Failures: a prefill
instance that always fails is retried elsewhere, a prefill killed mid-run gives correct answers or clean 503s,
none left gives a clear 503, a restarted one rejoins; a killed decode instance leaves nothing held on the
prefill side; no receive block leaks anywhere. `serve --disagg --num-prefill 1 --num-decode 1` runs it all."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import (descendants, free_port, is_engine_process, log_file, scrape, socket_inodes, start_vlserve, stop,
                                wait_healthy)
from tests.test_disagg import (
    BACKENDS,
    CASES,
    HB,
    N_TOKENS,
    THRESHOLD,
    ZMQ_ONLY,
    Cluster,
    ask,
    expected_text,
    picture_chat,
    wait_encoder_idle,
    wait_until,
)
from vlserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4})


# The decode instance's first run of blocks holds 32 tokens: longer prompts' KV arrives in several runs (resumes).
# With no prefill instance paired a request waits 1 s for one (not 5) before its 503: only the test that leaves
# none waits for it; every other one waits for its prefill instance to be paired before it asks.
DECODE_ARGS = ["--kv-allocate-tokens", "32", "--peer-wait-timeout", "1"]
# A killed prefill instance's clients are answered within seconds: the heartbeat window and a margin for the retry
# on the other prefill instance on a loaded 2-core machine. A guard against the waits of minutes seen before (not a
# performance check): requests nobody failed over would wait the transfer timeout (8 s) and more.
ANSWERED_WITHIN_S = float(HB) * int(THRESHOLD) + 12.0


def answer_or_503(client, messages):
    """The answer, or the 503 that says its prefill instance was lost (any other error fails the test)."""
    try:
        return ask(client, messages)
    except openai.APIStatusError as e:
        assert e.status_code == 503, e
        return e
# Tensor parallelism between real instances, every rank's KV cache in a file of its own that rank 0 maps: over
# ZeroMQ a prefill instance at two ranks (its writer reads every rank's heads out of their files) hands over to a
# decode instance at one (the rows written into its KV cache through the row socket its engine process serves);
# over shm a prefill instance at two ranks to a decode instance at two (each layer's keys and values read out of
# every prefill rank's file as the layer is computed, each decode rank's heads written into its own file; a
# prefill at one rank to a decode at two: `serve --disagg` below). The other backends: one rank each. "zmq+decode-tp2": over ZeroMQ into a decode instance at two ranks (a
# row socket per rank file, served by its engine process, granted per transfer there), for the test of every
# backend's write path.
TP2 = ["--tensor-parallel-size", "2"]
ZMQ_DECODE_TP = "zmq+decode-tp2"
PREFILL_ARGS = {"zmq": TP2, "shm": TP2}
DECODE_TP = {"shm": TP2, ZMQ_DECODE_TP: TP2}


def decode_args(variant: str) -> list[str]:
    return DECODE_ARGS + DECODE_TP.get(variant, [])


@pytest.fixture(scope="module", params=ZMQ_ONLY)
def pd(tiny_ckpt, request):
    """Bootstrap, encoder A, prefill P, decode "main" (DECODE_ARGS). Over ZeroMQ, or every backend for a test
    marked EVERY_PD_BACKEND. Shared by the tests of that backend: each starts with `whole(pd)`."""
    c = Cluster(tiny_ckpt("qwen2_vl"), {"main": decode_args(request.param)},
                prefills={"P": PREFILL_ARGS.get(request.param, [])},
                backend=request.param.split("+")[0], extra=("--transfer-timeout", "8"))
    c.variant = request.param
    yield c
    c.close_quickly()


def whole(pd: Cluster) -> Cluster:
    """The cluster as its fixture made it, whatever a test before did to it: one working prefill instance (the
    failing one stopped, a killed one replaced), a running decode instance, the two paired."""
    if pd.languages["main"].proc.poll() is not None:  # killed by a test: a new one with the same flags
        pd.start_language("main", decode_args(pd.variant))
    if "bad" in pd.prefills and pd.prefills["bad"].proc.poll() is None:
        pd.prefills["bad"].close()

    def good() -> list[str]:
        return [name for name, p in pd.prefills.items() if name != "bad" and p.proc.poll() is None]
    # The stopped failing one dropped first (counted until then), then a new one paired if none is left.
    pd.wait_prefills("main", len(good()))
    if not good():
        pd.start_prefill("P", PREFILL_ARGS.get(pd.variant, []))
        pd.wait_prefills("main", 1)
    return pd


EVERY_PD_BACKEND = pytest.mark.parametrize("pd", BACKENDS, indirect=True)
# and a decode instance at two ranks over zmq (a row socket per rank's file), where the write path differs
EVERY_PD_WRITE_PATH = pytest.mark.parametrize(
    "pd", [*BACKENDS, pytest.param(ZMQ_DECODE_TP, marks=ZMQ_ONLY[0].marks)], indirect=True)


def decode_holds_nothing(m: dict, model: str) -> bool:
    """A decode instance's metrics: no KV block in use, none reserved for a transfer (its KV cache is where
    prefill instances write) or, at several ranks, every receive block free."""
    if m['vlserve:kv_cache_usage_perc{model_name="%s"}' % model] != 0:
        return False
    if "vlserve:decode_kv_blocks_reserved" in m:
        return m["vlserve:decode_kv_blocks_reserved"] == 0
    return m['vlserve:kv_buffer_free_blocks{role="decode"}'] == m['vlserve:kv_buffer_total_blocks{role="decode"}']


def wait_nothing_held(pd: Cluster) -> None:
    """Every KV block back on the decode instance, every receive block on the prefill instances, no KV or
    transfer kept by a prefill."""
    wait_until(lambda: decode_holds_nothing(pd.metrics("main"), pd.ckpt),
               f"decode KV blocks leaked: {pd.metrics('main')}")
    for name, pre in pd.prefills.items():
        if pre.proc.poll() is not None:
            continue

        def prefill_idle():
            m = scrape(pre.metrics_url)
            return (m['vlserve:embedding_buffer_free_blocks{role="prefill"}']
                    == m['vlserve:embedding_buffer_total_blocks{role="prefill"}']
                    and m['vlserve:kv_cache_usage_perc{model_name="%s"}' % pd.ckpt] == 0
                    and m["vlserve:prefill_transfers_held"] == 0 and m["vlserve:prefill_requests_in_flight"] == 0
                    and m["vlserve:prefill_kv_rows_kept"] == 0)
        wait_until(prefill_idle, f"prefill {name} still holds something: {scrape(pre.metrics_url)}")


def sampled(client, messages, seed: int) -> str:
    resp = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=N_TOKENS,
                                          temperature=0.9, top_p=0.95, seed=seed, presence_penalty=0.5)
    return resp.choices[0].message.content


@EVERY_PD_WRITE_PATH  # the KV write path and its resumes are each backend's own
def test_e_p_d_matches_aggregated(pd, offline):
    whole(pd)
    client = pd.client("main")
    for name, messages in CASES.items():
        assert ask(client, messages) == expected_text(offline, messages), name
    chunks = list(client.chat.completions.create(model=client.served_model, messages=CASES["one image"],
                                                 stream=True, max_tokens=N_TOKENS, temperature=0,
                                                 extra_body={"min_tokens": N_TOKENS}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == expected_text(offline, CASES["one image"]), [c.choices[0].model_dump() for c in chunks]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, presence_penalty=0.5, max_tokens=N_TOKENS)
    want = offline.chat(CASES["three images"], params, use_tqdm=False)[0].outputs[0].text
    assert sampled(client, CASES["three images"], 5) == want  # the prefill's random state carried on
    with ThreadPoolExecutor(4) as pool:  # concurrent requests, some sharing pictures (prefix and encoder caches)
        chats = [picture_chat(10 + i % 3) for i in range(8)]
        assert list(pool.map(lambda m: ask(client, m), chats)) == [expected_text(offline, m) for m in chats]
    m = pd.metrics("main")
    assert m['vlserve:kv_transfer_resumes_total{role="decode"}'] > 0, "long prompts were meant to take more blocks"
    wait_nothing_held(pd)
    wait_encoder_idle(pd.encoders["A"].metrics_url)


def test_bad_requests_get_the_aggregated_status_and_token_ids_prefill_locally(pd, offline):
    client = whole(pd).client("main")
    ids = [11, 22, 33, 44, 55, 66]  # no text to send a prefill instance: the decode instance prefills it itself
    got = client.completions.create(model=client.served_model, prompt=ids, max_tokens=N_TOKENS, temperature=0,
                                    extra_body={"min_tokens": N_TOKENS}).choices[0].text
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    assert got == offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client.chat.completions.create(model=client.served_model, messages=CASES["text only"], n=2, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not a decodable image"):
        client.chat.completions.create(model=client.served_model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=client.served_model, messages=CASES["one image"], max_tokens=2040)
    assert ask(client, CASES["text only"])  # still serving
    wait_nothing_held(pd)


def test_a_decode_instances_front_end_maps_no_kv_file(pd, offline):
    """#67: the decode instance's front end mapped its engine's whole KV cache only to scan what prefill instances
    wrote there for NaN (57 MB read for a 2k-token prompt, in a process that owns none of those blocks). Now the
    rows are checked where they land (the engine's row socket, or the engine at admission): the front end maps no
    transfer file at all, its engine does, and answers are what they were."""
    client = whole(pd).client("main")
    assert ask(client, CASES["one image"]) == expected_text(offline, CASES["one image"])
    front = pd.languages["main"].proc.pid

    def transfer_files(pid: int) -> set[str]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile
            return set()
        return {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "vlserve-transfer-" in line}

    assert not transfer_files(front), transfer_files(front)
    assert transfer_files(_direct_engine(front)), "its engine maps no KV file: is its KV cache still shared?"


def test_failed_and_killed_prefill_instances(pd, offline):
    """A prefill that always fails is retried on the other; one killed mid-run gives correct answers or 503s;
    with only the failing one left, a clear 503; a restarted one rejoins. No block leaks on any role."""
    good = next(name for name, p in whole(pd).prefills.items() if name != "bad" and p.proc.poll() is None)
    pd.start_prefill("bad", env={"VLSERVE_TRANSFER_FAILURE_PROB": "1"})
    pd.wait_prefills("main", 2)
    client = pd.client("main")
    chats = [picture_chat(40 + i) for i in range(12)]  # keyed by their pictures: both prefills get some
    assert [ask(client, m) for m in chats] == [expected_text(offline, m) for m in chats]
    m = pd.metrics("main")
    assert m['vlserve:kv_transfers_total{role="decode",state="failed"}'] > 0, "the failing prefill was never tried"

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(answer_or_503, client, picture_chat(60 + i)) for i in range(8)]
        time.sleep(0.3)
        pd.prefills[good].kill()
        killed = time.monotonic()
        results = [f.result(timeout=90) for f in futures]
    assert time.monotonic() - killed < ANSWERED_WITHIN_S, "clients were answered later than the heartbeat window"
    for i, got in enumerate(results):
        assert isinstance(got, Exception) or got == expected_text(offline, picture_chat(60 + i))
    pd.wait_prefills("main", 1)
    with pytest.raises(openai.APIStatusError, match="injected") as err:
        ask(client, CASES["text only"])
    assert err.value.status_code == 503
    pd.prefills["bad"].kill()
    pd.wait_prefills("main", 0)
    with pytest.raises(openai.APIStatusError, match="no prefill instance is available") as err:
        ask(client, CASES["one image"])
    assert err.value.status_code == 503
    pd.start_prefill("P2")
    pd.wait_prefills("main", 1)
    assert ask(client, CASES["one image"]) == expected_text(offline, CASES["one image"])
    wait_nothing_held(pd)


def _direct_engine(pid: int) -> int:
    """The engine process a role started itself (not its tensor-parallel ranks below it)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    for child in map(int, out.split()):
        if is_engine_process(child):
            return child
    raise AssertionError(f"no engine process under {pid}")


# Where a transfer is when its prefill instance dies: the prefill's own counters say it (the kill follows within a
# poll): the request taken, a chunk of several sent, the last chunk sent (the decode instance may not have it yet).
KILL_POINTS = {"before the first chunk": "waiting_for_input", "mid-chunks": "transferring",
               "after the last chunk": "success"}


# (tests/test_peer_death.py kills a peer at each point in-process; here the real roles, at two of them)
@pytest.mark.parametrize("what,point", [("role", "before the first chunk"), ("engine", "mid-chunks")])
def test_a_prefill_killed_at_any_point_of_a_transfer_never_gives_a_500(pd, offline, what, point):
    """The prefill instance, or only its engine process, killed with requests in flight: every client gets its
    answer or a 503 naming the cause, never a 500 (before, a retry could send on the dead peer's closed socket:
    `ZMQError: Socket operation on non-socket`, then `Exception in ASGI application`); every decode block comes
    back."""
    whole(pd)
    (name, pre), = [(n, p) for n, p in pd.prefills.items() if p.proc.poll() is None]
    client = pd.client("main")
    counter = 'vlserve:kv_transfers_total{role="prefill",state="%s"}' % KILL_POINTS[point]
    seen = scrape(pre.metrics_url).get(counter, 0)

    with ThreadPoolExecutor(4) as pool:
        first = 100 + 4 * list(KILL_POINTS).index(point)
        futures = [pool.submit(answer_or_503, client, picture_chat(first + i)) for i in range(4)]
        wait_until(lambda: scrape(pre.metrics_url).get(counter, 0) > seen, f"no transfer reached {point}", 120)
        os.kill(_direct_engine(pre.proc.pid) if what == "engine" else pre.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result(timeout=90) for f in futures]
        took = time.monotonic() - killed
    assert took < ANSWERED_WITHIN_S, f"the last client was answered {took:.1f}s after the kill"
    for i, got in enumerate(results):
        messages = picture_chat(first + i)
        assert isinstance(got, Exception) or got == expected_text(offline, messages)
    log = pd.languages["main"].read_log()
    assert "Exception in ASGI application" not in log and "Socket operation on non-socket" not in log
    if what == "engine":  # its front end stops too (a supervisor restarts the instance)
        assert exit_code(pre, 60) == 1
    pd.prefills.pop(name).close()
    whole(pd)
    wait_nothing_held(pd)


def exit_code(role, timeout: float) -> int:
    """The role's exit code; one still running `timeout` s on fails the test with where its threads stand (the
    cluster's roles run with Python's fault handler, which prints them at SIGABRT)."""
    try:
        return role.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        role.proc.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(10)
        pytest.fail(f"{role.name} still ran {timeout:.0f} s on; its log ends:\n{role.read_log()[-8000:]}")


def _row_sockets(pid: int) -> list[str]:
    """The zmq row sockets (Unix sockets) the role `pid` and its engine processes listen on."""
    inodes = socket_inodes({pid} | descendants(pid))
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and "vlserve-rows-" in fields[7]:
            paths.append(fields[7])
    return sorted(set(paths))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a child as another user")
def test_a_local_user_without_the_secret_steers_no_role(pd, offline):
    """The issue's attack, as uid 65534 on the same machine: a TransferRequest to the prefill instance pointing at
    the decode instance's row socket with blocks 0-511, and writes straight into the row sockets. Nothing answers,
    and the same greedy request keeps its answer."""
    import msgspec

    from tests.test_peer_grants import as_nobody, ask_unsecured
    from vlserve.core.wire import Framer
    from vlserve.disagg.messages import ReceiverToSender, TransferRequest, TransferTarget
    from vlserve.disagg.transports.zmq import RowWrite
    from vlserve.engine.transfer_buffers import BufferLayout

    whole(pd)
    client = pd.client("main")
    assert ask(client, CASES["one image"]) == expected_text(offline, CASES["one image"])
    pre = next(p for p in pd.prefills.values() if p.proc.poll() is None)
    data = f"tcp://127.0.0.1:{pre.proc.args[pre.proc.args.index('--data-port') + 1]}"
    decode_rows = _row_sockets(pd.languages["main"].proc.pid)
    sockets = decode_rows + _row_sockets(pre.proc.pid)
    assert decode_rows, "the decode instance's engine serves no row socket"
    request = TransferRequest("rogue", 1, "hi", {}, {}, {}, list(range(512)), 16,
                              TransferTarget("zmq", BufferLayout("", 512, 16, 8, "float32"), f"ipc://{decode_rows[0]}"))
    asks = [(data, Framer(ReceiverToSender).encode(request))]  # (made here: the child only sends)
    asks += [(f"ipc://{path}", [msgspec.msgpack.encode(RowWrite(1, "", [0, 1, 2, 3], 64, time.time())),
                                bytes(64 * 8 * 4)]) for path in sockets]
    assert as_nobody(lambda: [ask_unsecured(address, frames) for address, frames in asks]) == [None] * len(asks)
    for _ in range(2):
        assert ask(client, CASES["one image"]) == expected_text(offline, CASES["one image"])
    wait_nothing_held(pd)


@EVERY_PD_BACKEND  # in place, the prefill's engine keeps the rows it writes: they must go too
def test_a_killed_decode_instance_leaves_nothing_held(pd):
    client = whole(pd).client("main")  # the next test that needs a decode instance starts a new one
    decode = pd.languages["main"]
    streaming = threading.Event()

    def long_answer(messages) -> bool:
        """True if the decode instance died under it."""
        try:
            for _ in client.chat.completions.create(model=client.served_model, messages=messages, stream=True,
                                                    max_tokens=400, temperature=0, extra_body={"min_tokens": 400}):
                streaming.set()
        except (openai.APIError, httpx.HTTPError):
            return True
        return False

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_answer, picture_chat(80 + i)) for i in range(6)]
        assert streaming.wait(60)
        decode.kill()
        cut = sum(f.result(timeout=60) for f in futures)
    assert cut, "the decode instance was meant to die with requests in flight"
    prefill = next(p for p in pd.prefills.values() if p.proc.poll() is None)

    def idle():  # transfers waiting for a resume expire after --transfer-timeout
        m = scrape(prefill.metrics_url)
        return (m["vlserve:prefill_transfers_held"] == 0 and m["vlserve:prefill_requests_in_flight"] == 0
                and m["vlserve:prefill_kv_rows_kept"] == 0
                and m['vlserve:kv_cache_usage_perc{model_name="%s"}' % pd.ckpt] == 0)
    wait_until(idle, f"the prefill instance kept work for a dead decode instance: {scrape(prefill.metrics_url)}",
               timeout=30)


def test_serve_disagg_runs_e_p_d_in_one_command(tiny_ckpt, offline):
    """With instances of different sizes: the decode instance at two ranks, the prefill instance at one (its KV
    re-sharded by heads on the way)."""
    port = free_port()
    log = log_file("serve-epd-")
    proc = start_vlserve(["serve", "--disagg", "--num-encoders", "1", "--num-prefill", "1", "--num-decode", "1",
                          "--decode-tensor-parallel-size", "2",
                          "--model", str(tiny_ckpt("qwen2_vl")), "--dtype", "float32", "--max-model-len", "2048",
                          "--limit-mm-per-prompt", "image=4", "--port", str(port), "--heartbeat-interval", "0.3"],
                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", 180, "serve --disagg E->P->D", lambda: Path(log.name).read_text()[-3000:])
        wait_until(lambda: scrape(url + "/metrics")["vlserve:prefill_instances_available"] == 1, "no prefill", 30)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        client.served_model = str(tiny_ckpt("qwen2_vl"))
        for messages in (CASES["one image"], CASES["text only"]):
            assert ask(client, messages) == expected_text(offline, messages)
        # SIGTERM (what Kubernetes and systemd send; Ctrl-C's SIGINT takes the same path in the launcher): every
        # role and engine process stops, quietly, and the port is free again
        family = descendants(proc.pid)
        assert len(family) >= 7  # bootstrap, encoder, prefill and decode, their engine processes, decode's rank 1
        said = len(Path(log.name).read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, Path(log.name).read_text()[-3000:]
    finally:
        stop(proc)
        log.close()
    alive = [p for p in family if os.path.exists(f"/proc/{p}") and "zombie" not in
             open(f"/proc/{p}/status").read().lower()]
    assert not alive, f"roles still running after SIGTERM: {alive}"
    at_stop = Path(log.name).read_text()[said:]
    assert " WARNING " not in at_stop and " ERROR " not in at_stop and "Traceback" not in at_stop, at_stop[-3000:]
    with socket.socket() as s:  # nobody listens (the answered connections may leave TIME_WAIT entries behind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    bad = subprocess.run([sys.executable, "-m", "vlserve", "serve", "--disagg", "--num-prefill", "1", "--model",
                          str(tiny_ckpt("qwen2_vl")), "--port", str(free_port())], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "--num-prefill P --num-decode D" in bad.stderr


def test_e_p_d_roles_share_the_cores_on_one_machine(monkeypatch):
    """Encoder, prefill and decode run at the same time: each gets its share of the cores unless the user chose
    OMP_NUM_THREADS; the registry gets none, and E->PD keeps every core for each role as before."""
    from vlserve.core.config import Options
    from vlserve.disagg.launcher import plan_children

    opts = Options()
    opts.engine.model = "/m"
    opts.disagg.num_encoders, opts.disagg.num_prefill, opts.disagg.num_decode = 1, 1, 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    children = {c.name: c.env.get("OMP_NUM_THREADS") for c in plan_children(opts, "INFO")}
    assert children == {"bootstrap": None, "encoder-0": share, "prefill-0": share, "decode-0": share}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert all("OMP_NUM_THREADS" not in c.env for c in plan_children(opts, "INFO"))
    monkeypatch.delenv("OMP_NUM_THREADS")
    opts.disagg.num_prefill = opts.disagg.num_decode = 0
    assert all("OMP_NUM_THREADS" not in c.env for c in plan_children(opts, "INFO"))
