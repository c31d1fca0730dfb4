"""LoRA adapter files under hostile use, second look (issue #78): a weights file whose tensors do not tile it
exactly, or whose header is over 8 MiB, is refused; an adapter over the host-memory bound is refused from its header
(at load, and in the engine without reading its tensors); the engine reads a runtime-loaded adapter again only
inside the --lora-dir it was loaded from, answering any failure there with one message; every weight kept owns its
memory; a failed read refuses each waiting request once (logged once); an encoder tells a peer no file paths."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tests.lora_utils import make_adapters, make_peft_adapter
from tests.open_recorder import recording_opens
from vlserve import LLM
from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError, ServiceUnavailableError
from vlserve.core.lora import AdapterRef
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import AddRequest, TensorRef
from vlserve.lora import files
from vlserve.lora.adapter import adapter_weights, read_adapter
from vlserve.lora.catalog import LoRACatalog
from vlserve.lora.files import read_files

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
CHANGED = "LoRA adapter 'conf' changed since it was loaded; load it again"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    return make_adapters(ckpt, tmp_path_factory.mktemp("adapters"), {"lm": ("lm", 1), "lm4": ("lm", 4)})


@pytest.fixture(scope="module")
def llm(ckpt):
    engine = LLM(str(ckpt), dtype="float32", enable_lora=True, num_kv_blocks=32)
    yield engine
    engine.shutdown()


def _rewrite(folder, edit) -> None:
    """The weights file with its header and data as `edit(header, data)` returns them."""
    raw = (folder / WEIGHTS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = edit(json.loads(raw[8 : 8 + n]), raw[8 + n :])
    text = json.dumps(header).encode()
    (folder / WEIGHTS).write_bytes(len(text).to_bytes(8, "little") + text + data)


def _shifted(header: dict, by: int) -> dict:
    return {k: v if k == "__metadata__" else {**v, "data_offsets": [o + by for o in v["data_offsets"]]}
            for k, v in header.items()}


def _overlapping(header: dict) -> dict:
    """Two tensors of one size on the same bytes (the bytes of the second then belong to none)."""
    by_size: dict[int, list[str]] = {}
    for k, v in header.items():
        if k != "__metadata__":
            by_size.setdefault(v["data_offsets"][1] - v["data_offsets"][0], []).append(k)
    first, second = next(names for names in by_size.values() if len(names) > 1)[:2]
    return {**header, second: {**header[second], "data_offsets": header[first]["data_offsets"]}}


EDITS = {"padded": lambda h, d: (h, d + bytes(4096)),
         "gap": lambda h, d: (_shifted(h, 16), bytes(16) + d),
         "overlap": lambda h, d: (_overlapping(h), d)}


@pytest.mark.parametrize("how", EDITS)
def test_a_weights_file_its_tensors_do_not_tile_is_refused(adapters, tmp_path, how):
    """As safetensors itself: the tensors fill the data exactly, from its first byte to the file's last."""
    assert read_files("lm", adapters["lm"], 1 << 30).tensors  # as saved: read
    folder = shutil.copytree(adapters["lm"], tmp_path / how)
    _rewrite(folder, EDITS[how])
    with pytest.raises(InvalidInputError, match="do not fill its data exactly"):
        read_files("bad", folder, 1 << 30)


def test_a_header_over_8_mib_is_refused(adapters, tmp_path):
    folder = shutil.copytree(adapters["lm"], tmp_path / "padded-header")
    _rewrite(folder, lambda h, d: ({**h, "__metadata__": {"pad": "x" * (1 << 20)}}, d))
    assert read_files("lm", folder, 1 << 30).tensors  # a header of 1 MiB is fine
    _rewrite(folder, lambda h, d: ({**h, "__metadata__": {"pad": "x" * (9 << 20)}}, d))
    with pytest.raises(InvalidInputError, match="header length does not fit"):
        read_files("bad", folder, 1 << 30)


class CountingHash:
    """blake3 as vlserve.lora.files uses it, counting the bytes it is given (what was read of the files)."""

    count = 0

    def __init__(self, data=b""):
        from blake3 import blake3

        self.h = blake3(data)
        CountingHash.count += len(data)

    def update(self, data):
        CountingHash.count += len(data)
        self.h.update(data)

    def hexdigest(self):
        return self.h.hexdigest()


def test_an_adapter_over_the_host_memory_bound_is_refused_from_its_header(llm, adapters, monkeypatch):
    """At load (the front end's catalog) and in the engine, before the tensors are read: a refused adapter costs
    its header, not a read of the whole file per request. The bound counts what host memory would hold."""
    monkeypatch.setattr(files, "blake3", CountingHash)
    size = (adapters["lm"] / WEIGHTS).stat().st_size
    cfg = llm.engine.cfg
    catalog = LoRACatalog(cfg.model, cfg.model_path, 16, max_host_bytes=1000, dtype=torch.float32)
    CountingHash.count = 0
    with pytest.raises(InvalidInputError, match="more than max_cpu_lora_memory_gb allows"):
        catalog.load("lm", adapters["lm"])
    assert CountingHash.count < size and "lm" not in catalog.adapters
    slots = llm.engine.core.lora
    ref = llm.engine.loras.load("lm", adapters["lm"])
    need = sum(t.numel() * t.element_size() for pair in slots.read(ref).values() for t in pair)
    bound = slots.max_cpu_bytes
    try:
        slots.max_cpu_bytes = need - 1
        for _ in range(2):
            CountingHash.count = 0
            with pytest.raises(InvalidInputError, match=f"take {need} bytes of host memory"):
                slots.read(ref)
            assert CountingHash.count < size
        slots.max_cpu_bytes = need
        assert slots.read(ref)
    finally:
        slots.max_cpu_bytes = bound


def test_the_engine_reads_a_runtime_adapter_again_only_inside_its_lora_dir(llm, adapters, tmp_path):
    """A runtime-loaded adapter's folder is swapped for a symlink out of --lora-dir, or for files that do not
    parse: the engine's read opens nothing out there and answers one message, no path or detail in it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(adapters["lm"], root / "ok")
    shutil.copytree(adapters["lm4"], outside / "adapter")
    ref = llm.engine.loras.load("conf", root / "ok", roots=(str(root),))
    slots = llm.engine.core.lora
    (root / "ok").rename(root / "ok-kept")
    (root / "ok").symlink_to(outside / "adapter")
    opened = []
    with recording_opens(lambda path, _: path.startswith(str(outside)) and opened.append(path)):
        with pytest.raises(InvalidInputError) as e:
            slots.read(ref)
    assert str(e.value) == CHANGED and opened == []
    (root / "ok").unlink()
    shutil.copytree(adapters["lm"], root / "ok")
    (root / "ok" / CONFIG).write_text('{"r": [1, 2')
    with pytest.raises(InvalidInputError) as e:
        slots.read(ref)
    assert str(e.value) == CHANGED
    shutil.rmtree(root / "ok")
    (root / "ok-kept").rename(root / "ok")
    assert slots.read(ref)  # its own files again


def test_every_weight_kept_owns_its_memory(tiny_ckpt, tmp_path):
    """float32 adapters of a float32 model (MoE expert weights included): no weight is a view into the file's
    bytes, which would keep the whole file in memory while the host-memory bound counts only the weights."""
    from vlserve.model.facts import resolve_model_facts

    moe = tiny_ckpt("qwen3_vl_moe")
    folder = make_peft_adapter(moe, tmp_path / "experts", "lm", experts=True)
    facts = resolve_model_facts(EngineArgs(model=str(moe), dtype="float32"), announce=False)
    catalog = LoRACatalog(facts.model, facts.path, 16)
    targets = catalog.targets()
    spec = read_adapter("experts", folder, targets, catalog._our_name, 16, 1 << 30, keep=True)
    weights = adapter_weights(spec, targets, torch.float32, torch.device("cpu"))
    assert any(targets[module].experts for module in weights) and any(not targets[m].experts for m in weights)
    kept = {module: [t.clone() for t in pair] for module, pair in weights.items()}
    spec.files.data[:] = bytes(len(spec.files.data))  # the file's bytes as read: a view would change with them
    for module, pair in weights.items():
        assert all(torch.equal(t, k) for t, k in zip(pair, kept[module])), module


class BrokenSlots:
    def __init__(self, error: Exception):
        self.error = error

    def holds(self, ref) -> bool:
        return False

    def read(self, ref):
        raise self.error


@pytest.mark.parametrize("error,status,message,logged", [
    (RuntimeError("disk on fire at /srv/secret/adapter"), 500, "internal error: RuntimeError", 1),
    (InvalidInputError("LoRA adapter 'a': refused"), 400, "LoRA adapter 'a': refused", 0),
], ids=["bug", "refusal"])
def test_a_failed_read_refuses_each_waiting_request_once(caplog, error, status, message, logged):
    """Three requests wait for one adapter whose read fails: each is refused with the same answer, built from
    the error (never the one exception raised again per request: its traceback would grow), logged once."""
    from vlserve.engine.core_process import EngineCoreLoop
    from vlserve.engine.lora_loader import AdapterLoader

    loop = EngineCoreLoop.__new__(EngineCoreLoop)  # its input handling alone: no engine, no sockets
    loop.rejected, loop.loader = [], AdapterLoader(BrokenSlots(error), threads=1)
    ref = AdapterRef("a", "/srv/secret/adapter", "a@0000", False)
    with caplog.at_level(logging.INFO):
        for rid in ("x", "y", "z"):
            loop._handle(AddRequest(rid, [1], [], TensorRef("int64", [3, 1], 0), 0, SamplingParams(max_tokens=1),
                                    0.0, lora=ref), [])
        deadline = time.monotonic() + 60
        while len(loop.rejected) < 3:
            assert time.monotonic() < deadline, loop.rejected
            loop.loader.admit_ready()
            time.sleep(0.01)
    assert [(r.request_id, r.message, r.status) for r in loop.rejected] == [(rid, message, status) for rid in "xyz"]
    assert len([r for r in caplog.records if r.exc_info]) == logged, caplog.text


def test_an_encoder_tells_a_peer_no_file_paths_when_its_adapter_cannot_be_read(caplog):
    """The detail (its own paths, the OS error) goes to the encoder's log; the peer's client gets a short 503."""
    from vlserve.disagg.encode_service import EncodeService

    secret = "/srv/secret/adapters/tower/adapter_model.safetensors"

    def read(ref):
        raise InvalidInputError(f"LoRA adapter 'tower': {secret} could not be opened (Permission denied)")

    svc = EncodeService.__new__(EncodeService)  # its adapter read alone
    svc.lora = SimpleNamespace(holds=lambda ref: False, read=read, insert=lambda ref, weights: None)
    svc._reading, svc.address = {}, "10.0.0.7:8101"
    svc.lora_reader = svc.vit = ThreadPoolExecutor(max_workers=1)
    try:
        with pytest.raises(ServiceUnavailableError) as e:
            asyncio.run(svc._take_adapter(AdapterRef("tower", "/srv/secret/adapters/tower", "tower@00", True)))
    finally:
        svc.lora_reader.shutdown()
    assert "encoder 10.0.0.7:8101 cannot apply LoRA adapter 'tower'" in str(e.value)
    assert "/srv" not in str(e.value) and "Permission" not in str(e.value), str(e.value)
    assert secret in caplog.text
