"""The multi-node shape on loopback (#30): a real etcd, two encoders, a prefill and a decode instance, each its own
process, meeting through `--registry etcd://`. Answers equal the aggregated engine's; a SIGKILLed encoder is dropped
(its key goes when its lease runs out) and a restarted one registers and gets work; while a SIGKILLed etcd is down
the paired roles keep answering, and once it is back on its data dir every live instance is registered and a
newcomer is found and paired through the watch; no receive block or transfer is left held.
`serve --disagg --registry etcd://` runs without a bootstrap."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.etcd_server import EtcdServer, needs_etcd
from tests.server_utils import RoleProcess, free_port, log_file, scrape, start_vlserve, stop, wait_healthy
from tests.test_disagg import (
    CASES,
    Cluster,
    ask,
    expected_text,
    picture_chat,
    wait_encoder_idle,
    wait_until,
)
from tests.test_pd_disagg import wait_nothing_held
from vlserve import LLM
from vlserve.disagg.etcd_client import EtcdClient
from vlserve.disagg.peer_kinds import ENCODER_PEERS, rendezvous_score

pytestmark = needs_etcd
ENCODED = 'vlserve:embedding_transfers_total{role="encode",state="success"}'
FAILURE_WINDOW = 3.0  # the longest lease TTL here: ceil(0.3 s x 10) of the prefill and decode (encoders: 2 s)


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4})


@pytest.fixture(scope="module")
def epd(tiny_ckpt, tmp_path_factory):
    """etcd; encoders A and B, prefill P, decode "main", all with --registry etcd://."""
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    try:
        c = Cluster(tiny_ckpt("qwen2_vl"), {"main": []}, prefills={"P": []}, encoders={"A": (), "B": ()},
                    registry=etcd.url, extra=("--transfer-timeout", "8"))
    except BaseException:
        etcd.kill()
        raise
    c.etcd = etcd
    yield c
    if etcd.proc.poll() is not None:  # a test that killed it failed before starting it again
        etcd.start()
    c.close_quickly()  # while etcd is up: each role revokes its lease
    etcd.kill()


def two_encoders(c: Cluster) -> list[RoleProcess]:
    """The state the fixture made, whatever a test before left (a killed encoder, a newcomer, etcd down): etcd up,
    exactly two encoders running, paired with the prefill instance and listed in etcd."""
    if c.etcd.proc.poll() is not None:
        c.etcd.start()
    keep = c.live_encoders()[:2]
    while len(keep) < 2:
        keep.append(f"E{len(c.encoders) + len(keep)}")
    c.use_encoders(*keep)
    wait_registered(c, "the two encoders never registered")
    return [c.encoders[name] for name in keep]


def registered(etcd: EtcdServer, namespace: str | None = None) -> dict[str, dict]:
    """key -> InstanceInfo (as JSON) of every instance under /vlserve/ (or /vlserve/<namespace>/), read from etcd."""
    async def read():
        client = EtcdClient([etcd.endpoint], timeout=5)
        try:
            return (await client.get_prefix(f"/vlserve/{namespace}/" if namespace else "/vlserve/"))[1]
        finally:
            await client.aclose()
    return {key: json.loads(value) for key, value in asyncio.run(read())}


def http_address(p: RoleProcess) -> str:
    return p.health_url.split("//", 1)[1].split("/", 1)[0]


def live(c: Cluster) -> dict[str, str]:
    """http address -> role of every role process still running: what etcd should list."""
    roles = [("encode", c.encoders), ("prefill", c.prefills), ("decode", c.languages)]
    return {http_address(p): role for role, procs in roles for p in procs.values() if p.proc.poll() is None}


def listed(c: Cluster) -> dict[str, str]:
    """http address -> role, as etcd lists them; the key names the role and instance its value describes."""
    out = {}
    for key, info in registered(c.etcd).items():
        assert key.endswith(f"/{info['role']}/{info['instance_id']}"), (key, info)
        out[info["http_address"]] = info["role"]
    return out


def wait_registered(c: Cluster, what: str, timeout: float = 15) -> None:
    wait_until(lambda: listed(c) == live(c), f"{what}: etcd lists {listed(c)}, running: {live(c)}", timeout)


def instance_id(c: Cluster, p: RoleProcess) -> str:
    return next(i["instance_id"] for i in registered(c.etcd).values() if i["http_address"] == http_address(p))


def chats_preferring(encoder_id: str, ids: list[str], first_seed: int, n: int) -> list[list[dict]]:
    """n one-picture chats whose picture prefers `encoder_id` among the encoders `ids` (the rendezvous hashing on
    content a receiver picks its encoder by, while the load is even)."""
    def favourite(messages) -> str:
        key = ENCODER_PEERS.affinity_key("", {"image": [messages[0]["content"][0]["image_url"]["url"]]}, {})
        return max(ids, key=lambda i: rendezvous_score(key, i))
    chats = (picture_chat(seed) for seed in itertools.count(first_seed))
    return list(itertools.islice((m for m in chats if favourite(m) == encoder_id), n))


def encoders_paired(c: Cluster) -> float:
    return scrape(c.prefills["P"].metrics_url)["vlserve:encoders_available"]


def all_exact(c: Cluster, offline, chats: list) -> None:
    client = c.client("main")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: ask(client, m), chats))
    assert got == [expected_text(offline, m) for m in chats]


def test_roles_meet_in_etcd_and_answer_exactly(epd, offline):
    two_encoders(epd)
    wait_registered(epd, "every role registers")
    assert sorted(listed(epd).values()) == ["decode", "encode", "encode", "prefill"]
    epd.wait_prefills("main", 1)
    wait_until(lambda: encoders_paired(epd) == 2, "the prefill instance never paired with both encoders")
    client = epd.client("main")
    for name, messages in CASES.items():
        assert ask(client, messages) == expected_text(offline, messages), name
    all_exact(epd, offline, [picture_chat(10 + i) for i in range(6)])


def test_a_killed_encoder_is_dropped_and_a_restarted_one_rejoins(epd, offline):
    dead, other = two_encoders(epd)
    dead_id, other_id = instance_id(epd, dead), instance_id(epd, other)
    failed = 'vlserve:embedding_transfers_total{role="prefill",state="failed"}'
    before = scrape(epd.prefills["P"].metrics_url)[failed]
    dead.kill()  # SIGKILL: no goodbye, its lease just stops being renewed
    for messages in chats_preferring(dead_id, [dead_id, other_id], 20, 2):  # one at a time: the key decides
        assert ask(epd.client("main"), messages) == expected_text(offline, messages)
    # The first went to the dead encoder and was retried on B once A missed its pings; the second went to B.
    assert scrape(epd.prefills["P"].metrics_url)[failed] == before + 1
    assert encoders_paired(epd) == 1
    wait_registered(epd, "the killed encoder's key outlived its lease", timeout=2 * FAILURE_WINDOW)
    assert not any(k.endswith(dead_id) for k in registered(epd.etcd))

    fresh = epd.start_encoder("A2")  # a new process: a new instance id, a new key
    wait_registered(epd, "the restarted encoder never registered")
    wait_until(lambda: encoders_paired(epd) == 2, "the restarted encoder was never paired")
    fresh_id = instance_id(epd, fresh)
    [messages] = chats_preferring(fresh_id, [fresh_id, other_id], 100, 1)
    assert ask(epd.client("main"), messages) == expected_text(offline, messages)
    assert scrape(fresh.metrics_url)[ENCODED] == 1, "the restarted encoder got no work"


def test_a_killed_etcd_leaves_paired_roles_serving_and_everyone_registers_again(epd, offline):
    two_encoders(epd)
    wait_registered(epd, "registered before etcd goes")
    before = set(listed(epd))
    epd.etcd.kill()
    down = time.monotonic()
    all_exact(epd, offline, [picture_chat(30 + i) for i in range(4)] + [CASES["text only"]])
    # Past every lease's failure window with etcd still down: peers stay paired (they are dropped by missed pings,
    # not by the registry), and requests still go through.
    time.sleep(max(0.0, down + FAILURE_WINDOW + 0.5 - time.monotonic()))
    assert encoders_paired(epd) == len([e for e in epd.encoders.values() if e.proc.poll() is None])
    assert epd.metrics("main")["vlserve:prefill_instances_available"] == 1
    all_exact(epd, offline, [picture_chat(40), CASES["three images"]])

    epd.etcd.start()  # the same data dir and port
    back = time.monotonic()
    for p in [p for p in epd.procs if p.proc.poll() is None]:  # each got through to etcd again
        wait_until(lambda: "keep-alives to etcd" in p.read_log() or p.read_log().count("registered ") > 1,
                   f"{p.name} never got back to etcd:\n{p.read_log()[-3000:]}")
    newcomer = epd.start_encoder("C")  # joins after the restart: the others learn of it through their watch
    wait_until(lambda: encoders_paired(epd) == 3, "the encoder that joined after etcd's restart was never paired")
    # The prefill's peer list is its registry's view, which only the watch (and its listings) keeps current.
    newcomer_id = instance_id(epd, newcomer)
    assert f"encoder {newcomer_id[:8]} at " in epd.prefills["P"].read_log()  # "... found; pairing"
    ids = [instance_id(epd, e) for e in epd.encoders.values() if e.proc.poll() is None]
    [messages] = chats_preferring(newcomer_id, ids, 200, 1)
    assert ask(epd.client("main"), messages) == expected_text(offline, messages)
    assert scrape(newcomer.metrics_url)[ENCODED] == 1, "the encoder that joined after etcd's restart got no work"
    # Past the failure window since etcd came back, every live instance is listed: the leases are kept alive.
    time.sleep(max(0.0, back + FAILURE_WINDOW + 0.5 - time.monotonic()))
    wait_registered(epd, "after etcd's restart", timeout=1)
    assert set(listed(epd)) == before | {http_address(newcomer)}
    all_exact(epd, offline, [picture_chat(50 + i) for i in range(4)])

    wait_nothing_held(epd)  # decode and prefill: every receive block back, no KV or transfer held
    for enc in epd.encoders.values():
        if enc.proc.poll() is None:
            wait_encoder_idle(enc.metrics_url)


def test_serve_disagg_with_etcd_starts_no_bootstrap(tiny_ckpt, offline, tmp_path):
    """The one-command launcher meeting in etcd (under --registry-namespace): no bootstrap child, an exact answer,
    and its keys revoked when it stops."""
    etcd = EtcdServer(tmp_path / "etcd").start()
    try:
        serve_disagg_in(etcd, tiny_ckpt("qwen2_vl"), offline)
    finally:
        etcd.kill()


def serve_disagg_in(etcd: EtcdServer, ckpt, offline) -> None:
    port, ns = free_port(), "serve-test"
    log = log_file("serve-etcd-")
    proc = start_vlserve(["serve", "--disagg", "--num-encoders", "1", "--model", str(ckpt), "--dtype", "float32",
                          "--max-model-len", "2048", "--limit-mm-per-prompt", "image=4", "--port", str(port),
                          "--heartbeat-interval", "0.3", "--registry", etcd.url, "--registry-namespace", ns],
                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/ready", 120, "serve --disagg --registry", lambda: Path(log.name).read_text()[-3000:])
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        commands = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in children]
        roles = sorted(cmd[cmd.index("vlserve") + 3] for cmd in commands if "vlserve" in cmd)  # after --log-level X
        assert roles == ["encode", "language"], commands
        assert f"meeting in {etcd.url}" in Path(log.name).read_text()
        assert sorted(i["role"] for i in registered(etcd, ns).values()) == ["encode", "language"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        client.served_model = str(ckpt)
        assert ask(client, CASES["one image"]) == expected_text(offline, CASES["one image"])
    finally:
        stop(proc)
        log.close()
    assert registered(etcd, ns) == {}  # each role revoked its lease on the way out
