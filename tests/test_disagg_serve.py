"""`vlserve serve --disagg` enforces every limit of the aggregated server with the same statuses, passes every
role its flags, survives an encoder crash (restarted with backoff; text keeps flowing meanwhile), and a language
server distrusts what encoders send: nonsense from an authenticated encoder becomes a retry elsewhere."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
import zmq
import zmq.asyncio

from tests.server_utils import HTTP, free_port, log_file, scrape, start_vlserve, stop, wait_healthy
from tests.test_disagg import (
    SECRET,
    Cluster,
    ask,
    expected_text,
    picture_chat,
    wait_language_blocks_free,
    wait_until,
)
from tests.test_server_api import _b64_safetensors, _big_noise_png, _bomb_png, image_part, user
from tests.test_structured_outputs import PERSON
from tests.test_tool_calls import TOOLS
from vlserve import LLM, SamplingParams

MAX_MEDIA_BYTES = 300_000


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 3})


@pytest.fixture(scope="module")
def deployment(tiny_ckpt):
    port = free_port()
    log = log_file("serve-disagg-")
    proc = start_vlserve(["serve", "--disagg", "--num-encoders", "2", "--model", str(tiny_ckpt("qwen2_vl")),
                          "--dtype", "float32", "--max-model-len", "2048", "--port", str(port), "--limit-mm-per-prompt",
                          "image=3", "--heartbeat-interval", "0.3", "--max-image-pixels", "1000000",
                          "--max-media-bytes", str(MAX_MEDIA_BYTES), "--transfer-timeout", "33"], stdout=log,
                         stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", 180, "serve --disagg", lambda: Path(log.name).read_text()[-3000:])
        deadline = time.monotonic() + 30
        while scrape(url + "/metrics")["vlserve:encoders_available"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        client.served_model = str(tiny_ckpt("qwen2_vl"))
        yield proc, url, client, log
    finally:
        stop(proc)
        log.close()


def _log_since(log, start: int = 0) -> str:
    """The deployment's log from offset `start` on (what a test's own actions wrote, when it noted the length
    first: the shared deployment's log also holds every earlier test's lines)."""
    log.seek(0)
    return log.read()[start:]


def _children(pid: int) -> dict[int, str]:
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            pass
    return out


# The aggregated server's statuses for these (tests/test_server_api.py): disaggregated must answer the same.
LIMITS = {
    "embeddings without --enable-mm-embeds": (user({"type": "image_embeds", "image_grid_thw": [1, 4, 4],
                                                    "image_embeds": _b64_safetensors(torch.zeros(4, 64))}, "hi"), 400),
    "decompression bomb over --max-image-pixels": (user(image_part(_bomb_png())), 413),
    "data URL over --max-media-bytes": (user(image_part(_big_noise_png())), 413),
    "too many images": (picture_chat(1, 2, 3, 4), 400),
    "not an image": (user(image_part("data:image/png;base64,aGVsbG8="), "hi"), 400),
    "loopback URL (SSRF policy on the encoders)": (user(image_part("http://127.0.0.1:9/x.png"), "hi"), 400),
    "upscaling past --max-image-pixels": (user(image_part(picture_chat(1)[0]["content"][0]["image_url"]["url"]),
                                               "hi"), 400),
}


def test_disaggregated_server_enforces_the_aggregated_limits(deployment, offline):
    _, url, client, _ = deployment
    assert ask(client, picture_chat(1)) == expected_text(offline, picture_chat(1))
    before = scrape(url + "/metrics")
    for name, (messages, status) in LIMITS.items():
        extra = {"mm_processor_kwargs": {"max_pixels": 2_000_000}} if name.startswith("upscaling") else {}
        r = HTTP.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == status, (name, r.text)
        assert ask(client, picture_chat(5)) == expected_text(offline, picture_chat(5))  # still serving
    after = scrape(url + "/metrics")
    failed = 'vlserve:embedding_transfers_total{role="language",state="failed"}'
    rejected = 'vlserve:embedding_transfers_total{role="language",state="rejected"}'
    assert after[failed] == before[failed], "a user's mistake was counted as a failed transfer"
    assert after[rejected] > before[rejected]
    wait_language_blocks_free(lambda: scrape(url + "/metrics"))


def test_structured_outputs_and_tool_calls_through_disagg(deployment, offline):
    """Pictures encoded elsewhere, the answer constrained on the language server: the aggregated JSON, and
    a forced tool call that is valid."""
    _, url, client, _ = deployment
    messages = picture_chat(2, text="Fill in the form.")
    resp = client.chat.completions.create(
        model=client.served_model, messages=messages, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": PERSON}),
                        use_tqdm=False)[0].outputs[0].text
    assert resp.choices[0].message.content == want
    jsonschema.validate(json.loads(want), PERSON)
    call = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=100,
                                          temperature=0, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.tool_calls
    wait_language_blocks_free(lambda: scrape(url + "/metrics"))


def test_every_role_gets_the_flags_it_honours(deployment):
    proc, *_ = deployment
    cmdlines = _children(proc.pid).values()
    encoders = [c for c in cmdlines if " encode " in c]
    language = next(c for c in cmdlines if " language " in c)
    assert len(encoders) == 2
    for enc in encoders:
        assert "--transfer-timeout 33" in enc and "--max-image-pixels 1000000" in enc
        assert f"--max-media-bytes {MAX_MEDIA_BYTES}" in enc and "--max-model-len" not in enc
    assert "--transfer-timeout 33" in language and "--max-model-len 2048" in language
    assert "--max-image-pixels" not in language and SECRET not in language


def test_encoder_crash_is_restarted_and_text_keeps_flowing(deployment, offline):
    proc, url, client, log = deployment
    start = len(_log_since(log))
    encoders = [pid for pid, cmd in _children(proc.pid).items() if " encode " in cmd]
    t0 = time.monotonic()
    os.kill(encoders[0], signal.SIGKILL)
    # Meanwhile: text needs no encoder, pictures go to the other one.
    assert ask(client, [{"role": "user", "content": "text only"}]) == expected_text(
        offline, [{"role": "user", "content": "text only"}])
    assert ask(client, picture_chat(9)) == expected_text(offline, picture_chat(9))
    deadline = time.monotonic() + 90
    while True:  # the restarted encoder registers anew and the language server pairs with it: a new pairing
        text = _log_since(log, start)
        if " paired (" in text and scrape(url + "/metrics")["vlserve:encoders_available"] == 2:
            break
        assert time.monotonic() < deadline, "the crashed encoder was not restarted"
        time.sleep(0.1)
    recovery = time.monotonic() - t0
    print(f"\nencoder crash -> restarted and paired again in {recovery:.1f}s")
    assert "restarting encoder-" in text
    assert ask(client, picture_chat(10)) == expected_text(offline, picture_chat(10))


# ---- an authenticated encoder that answers nonsense ------------------------------------------------------------
class NonsenseEncoder:
    """Holds the secret, pairs correctly, then answers every request with a chunk that must not be trusted."""

    KINDS = ("token ids beyond the vocabulary", "rows for text tokens", "a short rows frame", "a longer prompt")

    def __init__(self, bootstrap: str, width: int, architecture: str, side_rows: int = 0):
        self.bootstrap, self.architecture = bootstrap, architecture
        self.hidden, self.levels, self.width = width, side_rows, width * (1 + side_rows)
        self.served = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except asyncio.CancelledError:  # close()
            pass

    def close(self) -> None:
        """Deregisters and stops answering (the language server drops it after missed heartbeats)."""
        async def stop():
            await self.boot.stop()
            self.task.cancel()
            self.sock.close(linger=0)
            self.auth.stop()  # its ZAP socket too: then the context can end
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.ctx.term()
        self.loop.close()

    async def _main(self) -> None:
        from vlserve.core.wire import Framer, tensor_ref
        from vlserve.disagg.auth import PeerAuth
        from vlserve.disagg.bootstrap import BootstrapClient, InstanceInfo, new_instance_id
        from vlserve.disagg.messages import (
            PROTOCOL,
            TransferRequest,
            SenderToReceiver,
            ItemMeta,
            ReceiverToSender,
            Ping,
            Pong,
            RowSegment,
            TransferChunk,
        )

        self.task = asyncio.current_task()
        self.auth = auth = PeerAuth(SECRET)
        self.ctx = zmq.asyncio.Context()
        self.sock = sock = self.ctx.socket(zmq.ROUTER)
        auth.secure_server(sock)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.boot = boot = BootstrapClient(self.bootstrap, InstanceInfo(new_instance_id(), "encode", self.address),
                                           0.3, auth=auth)
        await boot.start()
        self.ready.set()
        inbox, outbox = Framer(ReceiverToSender), Framer(SenderToReceiver)
        while True:
            peer, *frames = await sock.recv_multipart()
            msg = inbox.decode(frames)
            if isinstance(msg, Ping):
                pong = Pong(msg.nonce, 0, self.architecture, self.hidden, self.levels, modalities=["image", "video"],
                            protocol=PROTOCOL)
                await sock.send_multipart([peer, *outbox.encode(pong)])
            elif isinstance(msg, TransferRequest):
                kind = self.KINDS[self.served % len(self.KINDS)]
                self.served += 1
                n = 20
                ids = torch.full((n,), 10**6 if kind.startswith("token") else 5, dtype=torch.int64)
                rows = torch.zeros(4 if kind == "rows for text tokens" else 1, self.width)
                segments = [RowSegment(0, rows.shape[0])] if kind != "a short rows frame" else [RowSegment(2, 3)]
                total = 10**7 if kind == "a longer prompt" else n
                items = [ItemMeta(2, 1, (1, 2, 2), "x")]
                tensors: list[torch.Tensor] = []
                chunk = TransferChunk(msg.request_id, msg.transfer_id, 0, n, total, 0, items, msg.block_ids,
                                      segments, partial=False, fill_ids=tensor_ref(ids, tensors),
                                      positions=tensor_ref(torch.zeros(n, 3, dtype=torch.int64), tensors),
                                      rows=tensor_ref(rows, tensors))
                await sock.send_multipart([peer, *outbox.encode(chunk, tensors)])


def test_a_language_server_whose_engine_dies_is_restarted(deployment, offline):
    """SIGKILL of the language server's engine process: the role exits (status 1) instead of answering 503
    forever, the supervisor restarts it, and it serves again."""
    proc, url, client, log = deployment
    language = next(pid for pid, cmd in _children(proc.pid).items() if " language " in cmd)
    start = len(_log_since(log))
    engine = int(re.findall(r"\[language\] .*engine core ready \(pid (\d+)\)", _log_since(log))[-1])
    assert engine in _children(language)
    os.kill(engine, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        restarted = "restarting language" in _log_since(log, start)
        try:
            ready = restarted and HTTP.get(url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            ready = False
        if ready:
            break
        assert time.monotonic() < deadline, "the language server was not restarted"
        time.sleep(0.2)
    assert language not in _children(proc.pid)
    assert HTTP.get(url + "/ready").json() == {"status": "ready", "degraded": []}
    assert ask(client, [{"role": "user", "content": "text only"}]) == expected_text(
        offline, [{"role": "user", "content": "text only"}])
    # The deployment whole again for the next test: the new language server paired with both encoders.
    wait_until(lambda: scrape(url + "/metrics")["vlserve:encoders_available"] == 2,
               "the restarted language server never paired with both encoders", 30)


@pytest.fixture(scope="module")
def cluster(tiny_ckpt):
    """Bootstrap, encoder A and language server "main" (the secret known): the tests that add an encoder of their
    own (a NonsenseEncoder in this process) share it; each closes its encoder and waits for A alone again."""
    c = Cluster(tiny_ckpt("qwen2_vl"), {"main": []})
    yield c
    c.close_quickly()


def test_nonsense_from_an_encoder_is_retried_elsewhere(cluster, offline):
    cluster.wait_encoders("main", 1)
    start = len(cluster.languages["main"].read_log())
    width = offline.config.model.text.hidden_size
    fake = NonsenseEncoder(cluster.bootstrap_url, width, offline.config.model.architecture)
    try:
        cluster.wait_encoders("main", 2)
        client = cluster.client("main")
        # Different pictures spread over both encoders by their content keys (rendezvous hashing): the fake gets
        # about half, at least its 4 kinds of nonsense but with a chance of ~1e-4; every answer is right.
        for i in range(24):
            messages = picture_chat(600 + i)
            assert ask(client, messages) == expected_text(offline, messages)
        assert fake.served >= len(NonsenseEncoder.KINDS)
        assert cluster.languages["main"].proc.poll() is None
        log = cluster.languages["main"].read_log()[start:]
        assert "does not check out" in log or "sent" in log
        wait_language_blocks_free(lambda: cluster.metrics("main"))
    finally:
        fake.close()
    cluster.wait_encoders("main", 1)


@pytest.mark.parametrize("mismatch", ["hidden size", "side rows"])
def test_an_encoder_of_another_model_is_never_paired(cluster, offline, mismatch):
    """An encoder whose rows do not fit this model (another hidden size, or DeepStack levels the language model
    does not have) is refused at pairing with a clear error, and requests keep going to the right one."""
    cluster.wait_encoders("main", 1)
    start = len(cluster.languages["main"].read_log())
    hidden = offline.config.model.text.hidden_size
    fake = NonsenseEncoder(cluster.bootstrap_url, hidden * 2 if mismatch == "hidden size" else hidden,
                           offline.config.model.architecture,
                           side_rows=3 if mismatch == "side rows" else 0)
    try:
        def refused() -> list[str]:  # this test's encoder, by its address
            return [x for x in cluster.languages["main"].read_log()[start:].splitlines()
                    if "not paired" in x and fake.address in x]
        wait_until(refused, "the mismatched encoder was never refused")
        assert cluster.metrics("main")["vlserve:encoders_available"] == 1
        line = refused()[0]
        assert ("hidden size 128" if mismatch == "hidden size" else "3 side rows per media token") in line, line
        messages = picture_chat(700)
        assert ask(cluster.client("main"), messages) == expected_text(offline, messages)
    finally:
        fake.close()
    cluster.wait_encoders("main", 1)


def test_a_crash_looping_role_never_takes_the_others_down(caplog, tmp_path, monkeypatch):
    """An encoder killed over and over is restarted ever more slowly (every 60 s once crash-looping); the
    supervisor never stops the deployment for it. Only a configuration error (exit 78) does."""
    import sys

    from vlserve.core.errors import EXIT_CONFIG
    from vlserve.core.processes import DEPLOYMENT_STATE_ENV, read_degraded
    from vlserve.disagg.launcher import CRASH_LOOP_BACKOFF_S, MAX_RESTARTS, Child, Supervisor

    def child(name: str, code: int | None) -> Child:
        script = "import time; time.sleep(60)" if code is None else f"raise SystemExit({code})"
        return Child(name, [sys.executable, "-c", script], {})

    crashing, healthy = child("encoder-0", 1), child("language", None)
    state = tmp_path / "deployment.state"
    sup = Supervisor([crashing, healthy], str(state))
    assert healthy.env[DEPLOYMENT_STATE_ENV] == str(state) and state.read_text() == ""
    for c in sup.children:
        c.start()
    now = 1000.0
    try:
        with caplog.at_level(logging.WARNING, logger="vlserve.disagg"):
            for _ in range(3 * MAX_RESTARTS):
                crashing.proc.wait(10)
                sup._check(now)
                assert not sup.stopping and healthy.running
                now = crashing.restart_at  # the supervisor's clock moves to the planned restart
                sup._check(now)
        assert any("crash-looping" in r.getMessage() for r in caplog.records)
        crashing.proc.wait(10)
        sup._check(now)
        assert crashing.restart_at - now == CRASH_LOOP_BACKOFF_S
        # The API roles' /ready reads this: the deployment serves, degraded, and says which role is missing.
        monkeypatch.setenv(DEPLOYMENT_STATE_ENV, str(state))
        assert [line.split(":")[0] for line in read_degraded()] == ["encoder-0"]
        assert "crash-looping" in read_degraded()[0]
        config_error = child("encoder-1", EXIT_CONFIG)
        sup.children.append(config_error)
        config_error.start()
        config_error.proc.wait(10)
        sup._check(now + 1)
        assert sup.stopping and sup.exit_code == EXIT_CONFIG
    finally:
        sup.shutdown()
    assert not state.exists()
