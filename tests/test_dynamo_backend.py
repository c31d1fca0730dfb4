"""vlserve as an NVIDIA Dynamo backend (`vlserve dynamo-worker`): the request mapping and the KV event relay here,
then a real deployment (etcd, NATS, Dynamo's frontend with its KV router, two vlserve workers) answering pictures
through the official `openai` client with the plain vlserve server's greedy answers, and routing a repeated
picture to the worker that holds it."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import noise_image
from tests.etcd_server import ETCD, EtcdServer
from tests.server_utils import HTTP, RemoteServer, log_file, start_vlserve, stop
from vlserve.core.errors import InvalidInputError
from vlserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from vlserve.core.processes import die_with_parent, free_port
from vlserve.dynamo.kv_relay import KVEventRelay, as_i64, pad_value, routing_tokens
from vlserve.dynamo.request import dynamo_prompt

EOS = {2}


def _request(**parts) -> dict:
    return {"token_ids": [5, 6, 7], **parts}


# ---- the request mapping ---------------------------------------------------------------------------------
def test_sampling_stops_and_media_map_onto_ours():
    req = _request(
        sampling_options={"temperature": 0.0, "top_p": 0.9, "top_k": 5, "seed": 7, "n": None, "best_of": 1,
                          "guided_decoding": {"regex": "[ab]+", "backend": None}},
        stop_conditions={"max_tokens": 9, "stop": ["x"], "stop_token_ids_hidden": [2, 11], "min_tokens": 1,
                         "stop_token_ids": [12], "ignore_eos": None},
        output_options={"logprobs": 2, "skip_special_tokens": True, "prompt_logprobs": None},
        multi_modal_data={"image_url": [{"Url": "data:image/png;base64,AAAA"}]},
        extra_args={"mm_hashes": ["d9c55b708daa6029"]})
    asked = dynamo_prompt(req, EOS)
    p = asked.params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (0.0, 0.9, 5, 7, 9, 1, 2)
    assert p.stop == ["x"] and p.stop_token_ids == [12, 11]  # 2 is the model's own end of sequence
    assert p.structured_outputs.regex == "[ab]+"
    assert asked.prompt == {"prompt_token_ids": [5, 6, 7],
                            "multi_modal_data": {"image": ["data:image/png;base64,AAAA"]}}
    assert asked.mm_hashes == ["d9c55b708daa6029"] and asked.max_tokens == 9


@pytest.mark.parametrize("part, field", [
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    ({"sampling_options": {"n": 3}}, "sampling_options.n"),
    ({"sampling_options": {"length_penalty": 0.5}}, "sampling_options.length_penalty"),
    ({"sampling_options": {"brand_new": 1}}, "sampling_options.brand_new"),
    ({"stop_conditions": {"max_thinking_tokens": 5}}, "stop_conditions.max_thinking_tokens"),
    ({"output_options": {"prompt_logprobs": 3}}, "output_options.prompt_logprobs"),
    ({"multi_modal_data": {"image_url": [{"Decoded": {}}]}}, "multi_modal_data.image_url"),
    ({"multi_modal_data": {"point_cloud": []}}, "multi_modal_data.point_cloud"),
    ({"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens"),
    ({"token_ids": []}, "token_ids"),
    ({"output_options": {"prompt_logprobs": 0}}, "output_options.prompt_logprobs"),
    ({"sampling_options": {"guided_decoding": {"structural_tag": "{}"}}}, "guided_decoding.structural_tag"),
    ({"prefill_result": {"x": 1}}, "prefill_result"),
    ({"encoder_result": {"x": 1}}, "encoder_result"),
    ({"sampling_options": {"guided_decoding": {"json": "{not json"}}}, "guided_decoding.json"),
])
def test_what_cannot_be_honoured_is_refused_by_name(part, field):
    with pytest.raises(InvalidInputError, match=re.escape(field)):
        dynamo_prompt(_request(**part), EOS)


# ---- routing tokens and the relay ----------------------------------------------------------------------------
class _Item:
    def __init__(self, offset: int, num_tokens: int, mm_hash: str = "ours"):
        self.offset, self.num_tokens, self.mm_hash = offset, num_tokens, mm_hash

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def test_pictures_ride_in_the_routing_tokens_as_dynamos_pad_values():
    assert pad_value("d9c55b708daa6029") == 230269545  # as Dynamo's frontend put it in routing_token_ids
    tokens = [1, 9, 50, 50, 50, 10, 3, 9, 50, 50, 10]
    items = [_Item(7, 4), _Item(1, 5)]  # out of order: matched to hashes by position in the prompt
    out = routing_tokens(tokens, items, ["00000000000000aa", "00000000000000bb"], {50})
    a, b = 1_000_000 + 0xaa, 1_000_000 + 0xbb
    assert out == [1, 9, a, a, a, 10, 3, 9, b, b, 10]
    assert routing_tokens(tokens, items, ["00000000000000aa"], {50}) == tokens  # counts differ: left as is


class _Publisher:
    def __init__(self):
        self.calls = []

    def publish_stored(self, **kw):
        self.calls.append(("stored", kw))

    def publish_removed(self, **kw):
        self.calls.append(("removed", kw))


_seq = iter(range(10**6))


def _batch(*events, seq: int | None = None) -> bytes:
    return encode_batch(KVEventBatch("r", next(_seq) if seq is None else seq, 0.0, list(events)))


def test_the_relay_publishes_known_blocks_with_their_tokens_and_removes_only_what_it_published():
    from vlserve.core.block_hash import chain_root, extend_block_hashes

    bs = 4
    ids = list(range(100, 114))  # 3 full blocks and 2 tokens
    items = [_Item(2, 3)]
    routing = routing_tokens(ids, items, ["00000000000000cc"], {102, 103, 104})
    relay = KVEventRelay("tcp://127.0.0.1:1", bs, max_blocks=16)
    relay.remember(ids, items, routing)
    hashes: list[bytes] = []
    extend_block_hashes(ids, items, bs, hashes, [], chain_root(None))
    pub = _Publisher()
    relay.apply(_batch(BlockStored(hashes[:2], None, bs)), pub)
    relay.apply(_batch(BlockStored([hashes[2], b"generated-block-hash"], hashes[1], bs)), pub)
    relay.apply(_batch(BlockStored([b"x" * 16], b"unknown-parent", bs)), pub)  # never published parent: dropped
    pad = 1_000_000 + 0xcc
    assert pub.calls == [
        ("stored", dict(token_ids=[100, 101, pad, pad, pad, 105, 106, 107], num_block_tokens=[4, 4],
                        block_hashes=[as_i64(h) for h in hashes[:2]], parent_hash=None)),
        ("stored", dict(token_ids=[108, 109, 110, 111], num_block_tokens=[4], block_hashes=[as_i64(hashes[2])],
                        parent_hash=as_i64(hashes[1])))]
    assert relay.unknown_blocks == 2
    pub.calls.clear()
    relay.apply(_batch(BlockRemoved([hashes[0], b"never-published"])), pub)
    relay.apply(_batch(AllBlocksCleared()), pub)
    assert pub.calls[0] == ("removed", {"block_hashes": [as_i64(hashes[0])]})
    assert sorted(pub.calls[1][1]["block_hashes"]) == sorted(as_i64(h) for h in hashes[1:])
    relay.apply(b"not msgpack", pub)  # dropped with a warning
    assert len(pub.calls) == 2


def test_a_lost_batch_makes_the_router_forget_what_it_was_told():
    relay = KVEventRelay("tcp://127.0.0.1:1", 2, max_blocks=8)
    relay.remember([1, 2, 3, 4], [], [1, 2, 3, 4])
    from vlserve.core.block_hash import chain_root, extend_block_hashes

    hashes: list[bytes] = []
    extend_block_hashes([1, 2, 3, 4], [], 2, hashes, [], chain_root(None))
    pub = _Publisher()
    relay.apply(_batch(BlockStored(hashes, None, 2), seq=5), pub)
    relay.apply(_batch(seq=6), pub)
    assert [c[0] for c in pub.calls] == ["stored"]
    relay.apply(_batch(seq=8), pub)  # 7 never came
    assert pub.calls[-1][0] == "removed" and sorted(pub.calls[-1][1]["block_hashes"]) == sorted(map(as_i64, hashes))


def test_the_relay_forgets_the_oldest_blocks_past_its_bound():
    relay = KVEventRelay("tcp://127.0.0.1:1", 2, max_blocks=3)
    relay.remember(list(range(10)), [], list(range(10)))  # 5 blocks
    assert len(relay._tokens) == 3


# ---- a real Dynamo deployment ---------------------------------------------------------------------------
def _dynamo_missing() -> str | None:
    try:
        import dynamo.common.backend  # noqa: F401
        import dynamo.frontend  # noqa: F401
    except ImportError as e:
        return f"the Dynamo wheels are not installed (`make install-dynamo`): {e}"
    if ETCD is None:
        return "no etcd binary (`make install` installs Debian's etcd-server where it can)"
    if shutil.which("nats-server") is None:
        return "no nats-server binary (`make install` installs Debian's nats-server where it can)"
    return None


needs_dynamo = pytest.mark.skipif(_dynamo_missing() is not None, reason=str(_dynamo_missing()))


class _Process:
    def __init__(self, name: str, cmd: list[str], env: dict, vlserve: bool = False):
        self.name, self.log = name, log_file(f"dynamo-{name}-")
        kwargs = dict(stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.proc = (start_vlserve(cmd, **kwargs) if vlserve else
                     subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, **kwargs))

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


class DynamoCluster:
    def __init__(self, tmp: Path, model: Path):
        self.etcd = EtcdServer(tmp / "etcd").start()
        nats_port = free_port()
        self.port = free_port()
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "ETCD_ENDPOINTS": self.etcd.endpoint,
                    "NATS_SERVER": f"nats://127.0.0.1:{nats_port}", "DYN_NAMESPACE": "vlserve-test",
                    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                    "DYN_EVENT_PLANE_HOST": "127.0.0.1", "HOME": str(tmp)}  # the frontend caches model cards there
        self.procs = [_Process("nats", ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port), "--store_dir",
                                        str(tmp / "nats")], self.env)]
        self.frontend = _Process("frontend", [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                              "--http-port", str(self.port), "--router-mode", "kv"], self.env)
        self.system_ports = [free_port(), free_port()]  # each worker's /metrics (vlserve's counters among them)
        self.workers = [_Process(f"worker{i}", ["dynamo-worker", "--model", str(model), "--served-model-name",
                                                "tiny", "--max-model-len", "4096", "--num-kv-blocks", "512",
                                                "--cpu-threads", "1"], {**self.env, "DYN_SYSTEM_PORT": str(port)},
                                 vlserve=True) for i, port in enumerate(self.system_ports)]
        # E->PD: a vlserve encoder found through vlserve's registry on the same etcd, and a worker serving the same
        # checkpoint as "tiny-epd" that sends its pictures there (rows over zmq)
        secret = {"VLSERVE_DISAGG_SECRET": "dynamo-test-secret-0123456789abcdef"}
        registry = ["--registry", f"etcd://127.0.0.1:{self.etcd.port}", "--transfer-backend", "zmq"]
        enc_port = free_port()
        self.encoder_metrics = f"http://127.0.0.1:{enc_port}/metrics"
        self.encoder = _Process("encoder", ["encode", "--model", str(model), "--port", str(enc_port), "--data-port",
                                            str(free_port()), "--cpu-threads", "1", *registry],
                                {**self.env, **secret}, vlserve=True)
        self.epd_worker = _Process("worker-epd", ["dynamo-worker", "--model", str(model), "--served-model-name",
                                                  "tiny-epd", "--max-model-len", "4096", "--num-kv-blocks", "512",
                                                  "--cpu-threads", "1", "--host", "0.0.0.0", *registry],
                                   {**self.env, **secret},
                                   vlserve=True)
        # Dynamo's own E->PD: an encode worker (a vlserve encoder inside) that Dynamo's frontend sends pictures to
        # first, and a language worker (--route-to-encoder) that takes the rows from the encoder Dynamo chose
        own = [*registry, "--registry-namespace", "dynamo-e-pd"]
        self.encode_system_port = free_port()
        self.encode_worker = _Process("encode-worker", ["dynamo-worker", "--disaggregation-mode", "encode",
                                                        "--model", str(model), "--served-model-name", "tiny-e",
                                                        "--cpu-threads", "1", *own],
                                      {**self.env, **secret, "DYN_SYSTEM_PORT": str(self.encode_system_port)},
                                      vlserve=True)
        self.routed_worker = _Process("worker-routed", ["dynamo-worker", "--route-to-encoder", "--model", str(model),
                                                        "--served-model-name", "tiny-e", "--max-model-len", "4096",
                                                        "--num-kv-blocks", "512", "--cpu-threads", "1", *own],
                                      {**self.env, **secret}, vlserve=True)
        self.procs += [self.frontend, *self.workers, self.encoder, self.epd_worker, self.encode_worker,
                       self.routed_worker]
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        self.worker_ids: list[int] = []
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.text()[-3000:]}")
            ids = [re.search(r"vlserve worker (\d+) ready for Dynamo", w.text()) for w in self.workers]
            others = (self.epd_worker, self.encode_worker, self.routed_worker)
            if all(ids) and all("ready for Dynamo" in w.text() for w in others):
                try:
                    models = {m["id"] for m in HTTP.get(self.url + "/v1/models", timeout=2).json()["data"]}
                except Exception:
                    models = set()
                if {"tiny", "tiny-epd", "tiny-e"} <= models:
                    self.worker_ids = [int(m.group(1)) for m in ids]
                    return
            time.sleep(0.5)
        raise TimeoutError("the Dynamo deployment did not come up:\n" +
                           "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in self.procs))

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.close()
        self.etcd.stop()


@pytest.fixture(scope="module")
def deployment(tiny_ckpt, tmp_path_factory):
    reason = _dynamo_missing()
    if reason is not None:
        pytest.skip(reason)
    model = tiny_ckpt("qwen2_vl")
    cluster = DynamoCluster(tmp_path_factory.mktemp("dynamo"), model)
    plain = RemoteServer(model, "--served-model-name", "tiny", "--max-model-len", "4096", "--cpu-threads", "1",
                         wait=False)
    try:
        cluster.wait_ready()
        plain.wait_healthy()
        yield cluster, plain
    finally:
        plain.close()
        cluster.close()


def _picture(seed: int, size: int = 112) -> str:
    buf = io.BytesIO()
    noise_image(size, size, seed).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(pictures: list[str], text: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in pictures),
                                         {"type": "text", "text": text}]}]


@needs_dynamo
def test_pictures_through_dynamos_frontend_get_the_plain_servers_greedy_answers(deployment):
    cluster, plain = deployment
    dyn, ours = cluster.client(), plain.client()
    cases = [([_picture(1)], "what is in the picture?"), ([_picture(2), _picture(3, 84)], "compare them"),
             ([], "hello there")]
    for pictures, text in cases:
        kw = dict(model="tiny", messages=_chat(pictures, text), max_tokens=8, temperature=0)
        want = ours.chat.completions.create(**kw)
        got = dyn.chat.completions.create(**kw)
        assert got.choices[0].message.content == want.choices[0].message.content, (pictures, text)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens  # the placeholders expanded alike
        streamed = "".join(c.choices[0].delta.content or "" for c in dyn.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == want.choices[0].message.content
    import openai

    with pytest.raises(openai.BadRequestError, match="use_beam_search|not supported"):
        dyn.chat.completions.create(model="tiny", messages=_chat([], "x"), max_tokens=2,
                                    extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        dyn.chat.completions.create(model="tiny", messages=_chat([], "x"), max_tokens=5000)
    # after refusals, the workers still answer
    assert dyn.chat.completions.create(model="tiny", messages=_chat([], "again"), max_tokens=2).choices


@needs_dynamo
def test_dynamos_kv_router_sends_a_repeated_picture_to_the_worker_that_holds_it(deployment):
    cluster, _ = deployment
    client = cluster.client()
    pictures = [_picture(10 + i, 224) for i in range(2)]

    def served_by(picture: str, pin: int | None = None) -> int:
        out = client.chat.completions.create(
            model="tiny", messages=_chat([picture], "describe this picture in a few words please"), max_tokens=2,
            temperature=0, extra_body={"nvext": {"extra_fields": ["worker_id"]}},
            extra_headers={"x-worker-instance-id": str(pin)} if pin is not None else None)
        return out.model_extra["nvext"]["worker_id"]["decode_worker_id"]

    # Each picture first goes to a worker of our choosing, then without a hint: the router must follow the KV
    # events to it (the text before the picture is cached on both, so only the picture's blocks tell them apart).
    for picture, worker in zip(pictures, cluster.worker_ids):
        assert served_by(picture, pin=worker) == worker
    time.sleep(1.0)  # the stored events reach the router
    for i in (0, 1, 1, 0, 0, 1):  # not alternating: round-robin or a coin would not pass
        assert served_by(pictures[i]) == cluster.worker_ids[i]


def _running(cluster: DynamoCluster) -> float:
    total = 0.0
    for port in cluster.system_ports:
        for line in HTTP.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("vlserve:num_requests_running"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@needs_dynamo
def test_a_client_that_leaves_mid_stream_frees_the_workers_engine(deployment):
    cluster, _ = deployment
    stream = cluster.client().chat.completions.create(
        model="tiny", messages=_chat([_picture(30)], "tell me a long story"), max_tokens=3000, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert _running(cluster) == 1  # still generating when the client leaves
    stream.close()
    deadline = time.monotonic() + 20
    while _running(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(cluster) == 0  # aborted in the engine, not generated to max_tokens for nobody
    assert cluster.client().chat.completions.create(model="tiny", messages=_chat([], "still there?"),
                                                    max_tokens=2).choices


@needs_dynamo
def test_e_pd_behind_dynamo_pictures_encoded_by_a_vlserve_encoder(deployment):
    """Dynamo's frontend in front of a worker whose pictures go to a vlserve encoder (found in vlserve's registry
    on the same etcd), the embeddings over vlserve's transport: the plain server's greedy answers."""
    cluster, plain = deployment

    def encoded() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in HTTP.get(cluster.encoder_metrics, timeout=10).text
                   .splitlines() if line.startswith('vlserve:embedding_transfers_total{role="encode",state="success"'))

    before = encoded()
    for pictures, text in (([_picture(40)], "what is this?"), ([_picture(41, 84), _picture(42)], "and these?"),
                           ([], "no picture")):
        kw = dict(messages=_chat(pictures, text), max_tokens=8, temperature=0)
        want = plain.client().chat.completions.create(model="tiny", **kw)
        got = cluster.client().chat.completions.create(model="tiny-epd", **kw)
        assert got.choices[0].message.content == want.choices[0].message.content, (pictures, text)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert encoded() - before >= 2  # the pictured prompts' embeddings came from the encoder


@needs_dynamo
def test_dynamos_e_pd_pattern_its_encode_worker_first_then_the_language_worker_takes_the_rows(deployment):
    """The frontend sends a picture request to the encode worker (a vlserve encoder: it encodes into its cache and
    names itself in encoder_result), then to the language worker, which takes the rows from that encoder: its
    cache hits, and the answers are the plain server's."""
    cluster, plain = deployment

    def hits() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in HTTP.get(
            f"http://127.0.0.1:{cluster.encode_system_port}/metrics", timeout=10).text.splitlines()
            if line.startswith("vlserve:encoder_cache_hits_total"))

    before = hits()
    for pictures, text in (([_picture(50)], "what is this?"), ([_picture(51, 84), _picture(52)], "and these?")):
        kw = dict(messages=_chat(pictures, text), max_tokens=8, temperature=0)
        want = plain.client().chat.completions.create(model="tiny", **kw)
        got = cluster.client().chat.completions.create(model="tiny-e", **kw)
        assert got.choices[0].message.content == want.choices[0].message.content, (pictures, text)
    assert hits() - before >= 3  # each picture encoded at Dynamo's encode step, then found by the transfer


@pytest.mark.skipif(_dynamo_missing() is not None and "wheels" in str(_dynamo_missing()), reason="no Dynamo wheels")
@pytest.mark.parametrize("flags", [["--disaggregation-mode", "encode"], ["--route-to-encoder"],
                                   ["--host", "0.0.0.0"]])
def test_encode_routing_without_a_registry_is_refused_at_start(flags):
    import argparse

    from vlserve.core.errors import ConfigurationError
    from vlserve.dynamo.flags import add_worker_flags, worker_setup

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    with pytest.raises(ConfigurationError, match="needs? --registry"):
        worker_setup(parser.parse_args(["--model", "some/model", *flags]))
