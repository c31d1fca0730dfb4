"""Which peer a request goes to (#26): encoders by the content of the media where it is known, prefill instances by
the prompt's prefix; rendezvous hashing among the peers within one request of the least loaded."""

from __future__ import annotations

import base64
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from vlserve.core.config import DisaggArgs
from vlserve.disagg.bootstrap import InstanceInfo
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_client import PeerClient, PeerConn
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PREFILL_PEERS, PREFIX_KEY_CHARS
from vlserve.engine.transfer_buffers import TransferBuffers

PICTURE = bytes(range(256)) * 40

PICTURE_MODEL = SimpleNamespace(max_model_len=1024, model=SimpleNamespace(modalities=("image", "video")))


@pytest.fixture(params=[ENCODER_PEERS, PREFILL_PEERS], ids=["encoders", "prefill"])
def client(request):
    """A receiver with four paired fake peers (nothing is sent: only the pick is looked at)."""
    buffers = TransferBuffers.create(4, 16, 8, torch.float32, shared=False)
    client = PeerClient(PICTURE_MODEL, buffers,
                        TransferMetrics(CollectorRegistry(), buffers, "language"),
                        DisaggArgs(bootstrap="127.0.0.1:9"), InstanceInfo("me", "language", "127.0.0.1:2"),
                        request.param)
    for i in range(4):
        client.conns[f"peer-{i}"] = PeerConn(InstanceInfo(f"peer-{i}", request.param.role, f"127.0.0.1:{10 + i}"),
                                             sock=None, paired=True)
    yield client
    client.transport.close()


def _pick(client, prompt: str = "p", media: dict | None = None, uuids: dict | None = None,
          exclude: frozenset = frozenset()) -> str:
    key = client.kind.affinity_key(prompt, media or {}, uuids or {})
    return client._pick(key, set(exclude)).info.instance_id


def _data_url(payload: bytes, label: str = "image/png", urlsafe: bool = False) -> str:
    text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(payload).decode()
    return f"data:{label};base64,{text.rstrip('=')}"


@pytest.mark.parametrize("client", [ENCODER_PEERS], indirect=True, ids=["encoders"])
def test_the_same_picture_sent_differently_goes_to_the_same_encoder(client):
    same = [_data_url(PICTURE), _data_url(PICTURE, "image/jpeg"), _data_url(PICTURE, urlsafe=True),
            _data_url(PICTURE).replace(",", ",\n", 1)]
    picks = {_pick(client, "a", {"image": [url]}) for url in same}
    assert len(picks) == 1, picks
    # A client-given id names the content whatever the URL; without one a URL is only itself.
    named = {_pick(client, "a", {"image": [f"http://host/{i}.png"]}, {"image": ["cat-7"]}) for i in range(20)}
    assert len(named) == 1, named
    by_url = {_pick(client, "a", {"image": [f"http://host/{i}.png"]}) for i in range(20)}
    assert len(by_url) > 1  # different URLs spread
    # The prompt text plays no part for an encoder.
    assert {_pick(client, f"text {i}", {"image": [_data_url(PICTURE)]}) for i in range(10)} == picks


@pytest.mark.parametrize("client", [PREFILL_PEERS], indirect=True, ids=["prefill"])
def test_prompts_sharing_a_prefix_go_to_the_same_prefill_instance_and_others_spread(client):
    system = "You are a careful assistant. " * (PREFIX_KEY_CHARS // 16)
    shared = {_pick(client, system + f"User: question {i}?") for i in range(20)}
    assert len(shared) == 1, shared
    assert _pick(client, "What is 2 + 2?") == _pick(client, "What is 2 + 2?")
    spread = Counter(_pick(client, f"User: question number {i}, please answer") for i in range(200))
    assert set(spread) == set(client.conns) and min(spread.values()) >= 25, spread  # ~50 each
    # The same text with different pictures (the text shows them as placeholders only) spreads too.
    pictures = Counter(_pick(client, "<image> What is this?", {"image": [_data_url(bytes([i]) * 64)]})
                       for i in range(200))
    assert set(pictures) == set(client.conns) and min(pictures.values()) >= 25, pictures


def test_a_busy_or_failed_peer_gives_the_key_to_the_next_in_its_order(client):
    key = client.kind.affinity_key("the same prompt", {"image": [_data_url(PICTURE)]}, {})
    first = client._pick(key, set())
    second = client._pick(key, {first.info.instance_id})  # the retry after a failure
    assert second is not first
    first.in_flight = 1  # within one request of the least loaded: it keeps its keys
    assert client._pick(key, set()) is first
    first.in_flight = 2  # busier: the key moves to its next choice, and back once it is not
    assert client._pick(key, set()) is second
    first.in_flight = 0
    assert client._pick(key, set()) is first
    for conn in client.conns.values():
        if conn is not first:
            conn.alive = False
    assert client._pick(key, {first.info.instance_id}) is None
