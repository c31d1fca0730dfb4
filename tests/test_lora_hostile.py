"""LoRA adapters under hostile use (issue #78): an adapter's files are read once and served from the bytes hashed,
bounded whatever stat says, refused when nested too deeply or holding absurd weights; host memory keeps more
adapters than slots, within a byte bound; the engine process reads an adapter off its loop (the request waits,
nobody else does; one aborted while it waits never starts); a peer names an adapter by name and content, never by
path, and an instance applies only its own; runtime loads stay inside --lora-dir and answer every refusal alike."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import shutil
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
from safetensors.torch import load_file, save_file

from tests.conftest import noise_image
from tests.lora_utils import make_adapters
from tests.open_recorder import recording_opens
from tests.test_disagg import data_url
from vlserve import LLM, LoRARequest, SamplingParams
from vlserve.core.config import DisaggArgs, EngineArgs, Options
from vlserve.core.errors import InvalidInputError, ServiceUnavailableError
from vlserve.core.processes import free_port
from vlserve.core.wire import (
    EngineInput,
    EngineMessage,
    EngineOutputs,
    FinishRequests,
    Framer,
    Shutdown,
    prompt_to_wire,
)
from vlserve.disagg.auth import PeerAuth
from vlserve.disagg.messages import ReceiverToSender, SenderToReceiver, TransferChunk, TransferFailed, TransferRequest
from vlserve.lora import slots as slots_module
from vlserve.lora.catalog import with_adapter

SECRET = "correct horse battery staple"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PICTURE = "<|vision_start|><|image_pad|><|vision_end|>What is this?"
FEW = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
OPENED: list[tuple[str, str]] = []  # (path, thread) of every file opened under a watched folder
WATCHED: list[str] = []


def _opened(path: str, thread: str) -> None:
    if path.startswith(tuple(WATCHED)):
        OPENED.append((path, thread))


@pytest.fixture
def watch():
    """watch(folder): files opened under it from now on are in OPENED (by path or relative to a folder's
    descriptor: tests/open_recorder.py)."""
    OPENED.clear()
    with recording_opens(_opened):
        yield lambda folder: WATCHED.extend({str(folder), os.path.realpath(folder)})
    WATCHED.clear()
    OPENED.clear()


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    return make_adapters(ckpt, tmp_path_factory.mktemp("adapters"),
                         {"lm": ("lm", 1), "lm4": ("lm", 4), "tower": ("tower", 2), "other": ("tower", 3)})


@pytest.fixture(scope="module")
def llm(ckpt):
    engine = LLM(str(ckpt), dtype="float32", enable_lora=True, num_kv_blocks=64)
    yield engine
    engine.shutdown()


def _copy(src, dst, config: dict | None = None, scale: float = 1.0):
    shutil.copytree(src, dst)
    if config is not None:
        (dst / CONFIG).write_text(json.dumps(json.loads((dst / CONFIG).read_text()) | config))
    if scale != 1.0:
        save_file({k: v * scale for k, v in load_file(dst / WEIGHTS).items()}, dst / WEIGHTS)
    return dst


def _length(path: str, most: int) -> int:
    with open(path, "rb") as f:
        return len(f.read(most))


def _refusal(llm, folder, name="bad") -> str:
    with pytest.raises(InvalidInputError) as e:
        llm.generate("hi", FEW, use_tqdm=False, lora_request=LoRARequest(name, 1, str(folder)))
    return str(e.value)


# ---- the files: read once, bounded, sane ---------------------------------------------------------------------
def test_the_weights_served_are_those_of_the_bytes_hashed(llm, adapters, tmp_path, monkeypatch):
    """The file is swapped for other weights right after it was hashed: what is served is still what was hashed."""
    folder = _copy(adapters["lm"], tmp_path / "swapped")
    ref = llm.engine.loras.load("swapped", folder)
    slots = llm.engine.core.lora
    slots.prepare(ref)
    first = {k: [t.clone() for t in pair] for k, pair in slots.host.pop(ref.key).items()}
    doubled = {k: v * 2 for k, v in load_file(folder / WEIGHTS).items()}
    from blake3 import blake3 as real_blake3

    class SwapAfterHash:  # the hash as the code computes it, and the swap an attacker makes right after
        def __init__(self, *args):
            self.h = real_blake3(*args)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            digest = self.h.hexdigest()
            save_file(doubled, folder / WEIGHTS)
            return digest

    for name in ("vlserve.lora.adapter", "vlserve.lora.files"):  # wherever the adapter's files are hashed
        if importlib.util.find_spec(name) is not None:
            monkeypatch.setattr(importlib.import_module(name), "blake3", SwapAfterHash, raising=False)
    slots.prepare(ref)
    served = slots.host[ref.key]
    assert served.keys() == first.keys()
    for k, (a, b) in first.items():
        assert torch.equal(served[k][0], a) and torch.equal(served[k][1], b), k


def test_a_config_nested_too_deep_is_refused_naming_it(llm, adapters, tmp_path):
    folder = _copy(adapters["lm"], tmp_path / "deep")
    (folder / CONFIG).write_text('{"peft_type": "LORA", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert "nests too deeply" in _refusal(llm, folder)


def test_the_config_bound_holds_whatever_stat_says(llm, adapters, tmp_path):
    """A /proc file says it is 0 bytes: the bound is on what is read, not on what stat says."""
    big = next((p for p in ("/proc/kallsyms", "/proc/self/smaps") if os.path.exists(p)
                and os.stat(p).st_size == 0 and _length(p, 2 << 20) > 1 << 20), None)
    if big is None:
        pytest.skip("no /proc file of more than 1 MiB here")
    folder = _copy(adapters["lm"], tmp_path / "proc")
    (folder / CONFIG).unlink()
    (folder / CONFIG).symlink_to(big)
    assert "over 1048576 bytes" in _refusal(llm, folder)


@pytest.mark.parametrize("config,scale,words", [
    (None, 1e19, "lora_A has entries over 10000"),
    ({"lora_alpha": 1e30}, 1.0, "lora_B x lora_alpha / r has entries over 10000"),
    ({"lora_alpha": int("9" * 400)}, 1.0, "must be a number"),
    (None, float("nan"), "non-finite weights"),
], ids=["weights-1e18", "alpha-1e30", "alpha-past-float", "nan"])
def test_absurd_weights_are_refused_naming_the_module(llm, adapters, tmp_path, config, scale, words):
    folder = _copy(adapters["lm"], tmp_path / "huge", config, scale)
    message = _refusal(llm, folder)
    assert words in message and ("self_attn" in message or "mlp" in message or "alpha" in message), message
    with pytest.raises(InvalidInputError, match=words):  # at load (a runtime load, --lora-modules), not per request
        llm.engine.loras.load("huge", folder)
    assert llm.generate("hi", FEW, use_tqdm=False)[0].outputs[0].token_ids  # the engine serves on


# ---- host memory ---------------------------------------------------------------------------------------------
def test_host_memory_keeps_more_adapters_than_slots_within_a_byte_bound(ckpt, llm, adapters):
    from vlserve.engine.config import lora_config

    assert lora_config(EngineArgs(enable_lora=True, max_loras=1)).max_cpu_loras >= 4
    assert lora_config(EngineArgs(enable_lora=True, max_loras=8)).max_cpu_loras == 16
    assert lora_config(EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=3)).max_cpu_loras == 3
    slots = llm.engine.core.lora
    slots.host.clear()
    lm, lm4 = (LoRARequest(n, 1, str(adapters[n])) for n in ("lm", "lm4"))
    for req in (lm, lm4, lm):  # two adapters taking turns: each read once
        llm.generate("hi", FEW, use_tqdm=False, lora_request=req)
    assert len(slots.host) == 2
    one = slots.host_bytes // 2
    slots.max_cpu_bytes = int(1.5 * one)
    llm.generate("hi", FEW, use_tqdm=False, lora_request=LoRARequest("tower", 1, str(adapters["tower"])))
    assert slots.host_bytes <= slots.max_cpu_bytes  # the least recently used went
    slots.max_cpu_bytes = one // 4
    assert "max_cpu_lora_memory_gb" in _refusal(llm, adapters["lm4"], "lm4")
    slots.max_cpu_bytes = 2**30
    small = LLM(str(ckpt), dtype="float32", enable_lora=True, num_kv_blocks=16, max_cpu_lora_memory_gb=0.5)
    assert small.engine.core.lora.max_cpu_bytes == 2**29
    small.shutdown()


# ---- the engine process reads adapters off its loop ----------------------------------------------------------
def test_an_adapter_is_read_off_the_engine_loop_and_an_abort_while_it_waits_holds(llm, adapters, monkeypatch):
    """The engine core's loop (vlserve.engine.core_process) over in-process sockets: while request A's adapter is
    read (held up here), request B without one runs to its end; A, aborted while it waits, never starts; C, with
    the same adapter after the read, runs with it. One read, on a loader thread. A held request counts as waiting."""
    from vlserve.engine.core_process import EngineCoreLoop, Progress

    core, processor = llm.engine.core, llm.engine.input_processor
    ref = llm.engine.loras.load("slow", adapters["lm"])
    core.lora.host.pop(ref.key, None)
    gate, started, reads = threading.Event(), threading.Event(), []
    real = slots_module.read_adapter

    def slow(name, *args, **kwargs):
        if name == "slow":
            reads.append(threading.current_thread().name)
            started.set()
            gate.wait(120)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(slots_module, "read_adapter", slow)
    ctx = zmq.Context()
    send, inputs, outputs, recv = (ctx.socket(t) for t in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    tag = f"{os.getpid()}-{id(ctx)}"
    send.bind(f"inproc://in-{tag}")
    inputs.connect(f"inproc://in-{tag}")
    outputs.bind(f"inproc://out-{tag}")
    recv.connect(f"inproc://out-{tag}")
    loop = EngineCoreLoop(core, inputs, outputs, Progress(), os.getppid())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    framer, answers = Framer(EngineInput), Framer(EngineMessage)
    tokens, finished, rejected, waiting = defaultdict(list), set(), {}, []

    def add(rid: str, lora) -> None:
        msg, tensors = prompt_to_wire(rid, with_adapter(processor.process("tell me a story"), lora), FEW,
                                      time.monotonic())
        send.send_multipart(framer.encode(msg, tensors))

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            if recv.poll(100):
                msg = answers.decode(recv.recv_multipart())
                if isinstance(msg, EngineOutputs):
                    for out in msg.outputs:
                        tokens[out.request_id] += out.new_token_ids
                        if out.finish_reason is not None:
                            finished.add(out.request_id)
                    rejected.update({r.request_id: r.message for r in msg.rejected})
                    waiting.append(msg.stats.num_requests_waiting)

    try:
        add("A", ref)
        assert started.wait(60)
        until(lambda: waiting[-1:] == [1], "a request waiting for its adapter was not counted as waiting")
        add("B", None)
        until(lambda: "B" in finished, "a request without the adapter waited for its read")
        send.send_multipart(framer.encode(FinishRequests(["A"], "abort")))
        until(lambda: "A" in rejected, "the abort of a request waiting for its adapter was not answered")
        gate.set()
        add("C", ref)
        until(lambda: "C" in finished, "a request with the adapter did not run once it was read")
        assert "A" not in tokens and "A" not in core.scheduler.requests
        assert len(reads) == 1 and reads[0].startswith("vlserve-lora"), reads
    finally:
        gate.set()
        send.send_multipart(framer.encode(Shutdown()))
        thread.join(60)
        for sock in (send, inputs, outputs, recv):
            sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive()  # the engine is the offline LLM's again
    assert tokens["C"] == llm.generate("tell me a story", FEW, use_tqdm=False, lora_request=LoRARequest(
        "slow", 1, str(adapters["lm"])))[0].outputs[0].token_ids


# ---- peers name adapters by name and content; each applies only its own -------------------------------------
@pytest.fixture(scope="module")
def encoder(ckpt, adapters):
    """An encode service serving adapter "tower" (--lora-modules), with the shared secret, on its own loop."""
    from vlserve.disagg.encode_service import EncodeService

    port = free_port()
    opts = Options(engine=EngineArgs(model=str(ckpt), dtype="float32", enable_lora=True,
                                     lora_modules=(f"tower={adapters['tower']}",)),
                   disagg=DisaggArgs(disagg_secret=SECRET, data_port=port))
    svc = EncodeService(opts)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def serve():
        svc.bind()
        ready.set()
        try:
            await svc.serve()
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert ready.wait(60)
    yield SimpleNamespace(service=svc, port=port)
    for task in asyncio.all_tasks(loop):
        loop.call_soon_threadsafe(task.cancel)
    thread.join(30)
    loop.run_until_complete(svc.aclose())
    loop.close()


def _ask(port: int, header: bytes, wait_s: float = 60) -> object | None:
    """A secret-holding peer's raw request; the first answer (None: none within wait_s)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    PeerAuth(SECRET).secure_client(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([header])
        return Framer(SenderToReceiver).decode(sock.recv_multipart()) if sock.poll(int(wait_s * 1000)) else None
    finally:
        sock.close()


def _request(rid: str, lora=None) -> TransferRequest:
    picture = data_url(noise_image(56, 56, 5))
    return TransferRequest(rid, 0, PICTURE, {"image": [picture]}, {"image": [None]}, {}, list(range(64)), 16,
                           lora=lora)


def test_a_peer_naming_an_adapter_by_path_or_not_as_served_reads_nothing(encoder, adapters, watch):
    from vlserve.lora.catalog import LoRACatalog

    svc = encoder.service
    served = LoRACatalog(svc.cfg.model, svc.cfg.model_path, 16).load("tower", adapters["tower"])
    watch(adapters["other"])
    watch(adapters["tower"])
    # today's layout, with a path: not a message peers speak (dropped unanswered), nothing read there
    raw = msgspec.to_builtins(_request("by-path"))
    raw["lora"] = ["other", str(adapters["other"]), served.key, True]
    with pytest.raises(msgspec.DecodeError):
        Framer(ReceiverToSender).decode([msgspec.msgpack.encode(raw)])
    assert _ask(encoder.port, msgspec.msgpack.encode(raw), wait_s=3) is None
    # a name it does not serve, or its name with other content: a 503 naming it, nothing read
    from vlserve.core.lora import PeerAdapter

    for rid, named in (("unknown", PeerAdapter("other", served.key, True)),
                       ("wrong-key", PeerAdapter("tower", "tower@0000000000000000", True))):
        answer = _ask(encoder.port, msgspec.msgpack.encode(msgspec.to_builtins(_request(rid, named))))
        assert isinstance(answer, TransferFailed) and answer.status == 503, answer
        assert f"cannot apply LoRA adapter {named.name!r}" in answer.message and "--lora-modules" in answer.message
    assert OPENED == [] and not svc.lora.host  # nothing read, nothing held
    # the adapter it serves, by name and key: applied, its files read on the loader thread (never the vision one)
    # (a raw peer has no receive buffers for the rows: how the send ends is not the point here)
    answer = _ask(encoder.port, msgspec.msgpack.encode(msgspec.to_builtins(_request("good", served.for_peer()))))
    assert isinstance(answer, TransferChunk) or "LoRA" not in answer.message, answer
    assert svc.lora.holds(served)
    assert OPENED and all(path.startswith(str(adapters["tower"])) for path, _ in OPENED), OPENED
    assert all(thread.startswith("vlserve-lora") for _, thread in OPENED), OPENED


def test_a_prefill_instance_applies_only_its_own_adapters(llm, adapters, watch):
    from vlserve.core.lora import PeerAdapter
    from vlserve.disagg.prefill_service import PrefillService

    own = llm.engine.loras.load("mine", adapters["lm"])
    svc = PrefillService.__new__(PrefillService)  # its adapter check alone: no engine process, no socket
    svc.engine, svc.address = SimpleNamespace(loras=llm.engine.loras), "10.0.0.9:8201"
    watch(adapters["lm"])
    assert svc._adapter(PeerAdapter("mine", own.key, own.towers)) is own
    for named in (PeerAdapter("mine", "mine@ffffffffffffffff", False), PeerAdapter("yours", own.key, False)):
        with pytest.raises(ServiceUnavailableError, match=f"prefill instance 10.0.0.9:8201 cannot apply LoRA "
                                                          f"adapter {named.name!r}.*--lora-modules"):
            svc._adapter(named)
    svc.engine = SimpleNamespace(loras=None)
    with pytest.raises(ServiceUnavailableError, match="--enable-lora"):
        svc._adapter(PeerAdapter("mine", own.key, own.towers))
    assert OPENED == []


# ---- runtime loads: inside --lora-dir, one answer for every refused path ------------------------------------
@pytest.fixture
def lora_dir(adapters, tmp_path):
    """--lora-dir `root` holding adapter "ok", a symlink to it, and folders that must not load; `outside` beside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    _copy(adapters["lm"], root / "ok")
    _copy(adapters["lm4"], outside / "adapter")
    (root / "inner-link").symlink_to(root / "ok")
    (root / "escape").symlink_to(outside / "adapter")
    (root / "empty").mkdir()
    _copy(adapters["lm"], root / "fifo")
    (root / "fifo" / CONFIG).unlink()
    os.mkfifo(root / "fifo" / CONFIG)
    _copy(adapters["lm"], root / "half")
    (root / "half" / WEIGHTS).unlink()
    (root / "half" / WEIGHTS).symlink_to(outside / "adapter" / WEIGHTS)
    return root, outside


def test_every_refused_runtime_path_gets_one_message(llm, lora_dir, watch):
    root, outside = lora_dir
    catalog = llm.engine.loras
    assert catalog.load("ok", root / "ok", roots=(str(root),)).path == str(root / "ok")
    assert catalog.load("ok", root / "inner-link", roots=(str(root),)).path == str(root / "ok")  # resolved once
    watch(outside)
    paths = [root / "missing", root / "ok" / CONFIG, outside / "adapter", root / "escape", root / "empty",
             root / "fifo", root / "half", root / "ok\0nul", root / ".." / "outside" / "adapter"]
    messages = set()
    for path in paths:
        with pytest.raises(InvalidInputError) as e:
            catalog.load("x", str(path), roots=(str(root),))
        messages.add(str(e.value).replace(repr(str(path)), "PATH"))
    assert len(messages) == 1, messages
    assert "--lora-dir" in messages.pop()
    assert OPENED == [] and "x" not in catalog.adapters


def _swap_for_a_symlink(root, outside) -> None:
    (root / "ok").rename(root / "ok-kept")
    (root / "ok").symlink_to(outside / "adapter")


def test_a_folder_swapped_for_a_symlink_after_it_was_resolved_is_refused(llm, lora_dir, monkeypatch, watch):
    """The path is resolved once; the folder is then swapped for a symlink out of --lora-dir before it is opened:
    the opening walks down without following it (and nothing under the symlink's target is opened)."""
    root, outside = lora_dir
    real_realpath = os.path.realpath

    def resolve_then_swap(path, *args, **kwargs):
        resolved = real_realpath(path, *args, **kwargs)
        if str(path) == str(root / "ok") and not (root / "ok-kept").exists():
            _swap_for_a_symlink(root, outside)
        return resolved

    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    watch(outside)
    with pytest.raises(InvalidInputError, match="is not an adapter folder this server may load"):
        llm.engine.loras.load("swapped", str(root / "ok"), roots=(str(root),))
    assert (root / "ok-kept").exists() and OPENED == []


def test_both_files_come_from_the_one_folder_resolved(llm, lora_dir, monkeypatch, watch):
    """The folder is swapped for a symlink out of --lora-dir after its config was opened: the weights still come
    from the folder that was resolved (the one the config came from), never from two folders."""
    from vlserve.lora import files

    root, outside = lora_dir
    expected = llm.engine.loras.load("ok", root / "ok", roots=(str(root),)).key.split("@")[1]
    real_open_file = files._open_file

    def open_then_swap(name, path, *args, **kwargs):
        fd = real_open_file(name, path, *args, **kwargs)
        if str(path).endswith(CONFIG):
            _swap_for_a_symlink(root, outside)
        return fd

    monkeypatch.setattr(files, "_open_file", open_then_swap)
    watch(outside)
    ref = llm.engine.loras.load("swapped", str(root / "ok"), roots=(str(root),))
    assert ref.key == f"swapped@{expected}" and (root / "ok-kept").exists() and OPENED == []


def test_a_runtime_load_without_lora_dir_is_refused_naming_it():
    from vlserve.frontend.served_adapters import ServedAdapters

    served = ServedAdapters(SimpleNamespace(adapters={}), "base", executor=None)
    with pytest.raises(InvalidInputError, match="--lora-dir"):
        asyncio.run(served.load("x", "/adapters/x", lora_dirs=()))
