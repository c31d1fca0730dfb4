"""The router's block hashes equal the engine's. The router runs `InputProcessor.layout` (no resize or patchify;
a re-sent picture or video is a lookup in the family's layout cache) on the prompt as the client sent it (data
URLs as text); the engine runs `process` on the fetched bytes. Both must give the same token ids, items and so
block hashes, for pictures, videos and text, on the Qwen and LLaVA families (test_kv_events checks the engine
stores `prompt_block_hashes` of `process`). Then `PromptHasher` end to end on a chat request: a picture it has not
seen is hashed aside, the request hinted by the blocks before it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import pytest

from tests.conftest import noise_image
from tests.test_video import clip_frames, encode_video
from vlserve.cli import build_parser
from vlserve.core.block_hash import prompt_block_hashes
from vlserve.core.config import ROUTER, EngineArgs
from vlserve.core.options import options_from
from vlserve.engine.config import resolve_config
from vlserve.frontend.chat import parse_chat_messages
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.tokenizer import render_chat
from vlserve.media.data_url import decode_data_url
from vlserve.router.prompts import PromptHasher
from vlserve.server.protocol import ChatCompletionRequest

BLOCK = 4  # small blocks: many of them straddle a media item
ARCHS = ["qwen2_vl", "qwen3_vl", "llava_onevision", "llava_next_video"]


def picture_url(seed: int, side: int = 90) -> str:
    buf = io.BytesIO()
    noise_image(side, side + 14, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video_url(seed: int) -> str:
    return "data:video/mp4;base64," + base64.b64encode(encode_video(clip_frames(6, seed=seed), fps=2)).decode()


def chat_prompt(proc: InputProcessor, parts: list[dict]) -> dict:
    """The prompt the server (and the router) make of one user message: template, placeholders, data URLs."""
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": parts}]
    chat = parse_chat_messages(messages, allow_python_objects=False, modalities=proc.modalities)
    return chat.prompt(render_chat(proc.tokenizer, chat.messages, True))


def fetched(prompt: dict) -> dict:
    """What the server's fetchers hand the engine's processor: the data URLs' bytes."""
    media = {kind: [decode_data_url(u) for u in urls] for kind, urls in prompt.get("multi_modal_data", {}).items()}
    return {**prompt, "multi_modal_data": media}


@pytest.fixture(scope="module")
def procs(tiny_ckpt):
    made = {}

    def get(arch: str) -> InputProcessor:
        if arch not in made:
            cfg = resolve_config(EngineArgs(model=str(tiny_ckpt(arch)), dtype="float32"), announce=False)
            made[arch] = InputProcessor.for_model(cfg)
        return made[arch]

    return get


def assert_same(proc: InputProcessor, prompt: dict) -> None:
    engine = proc.process(fetched(prompt))
    router = proc.layout(prompt)
    assert router.prompt_token_ids == engine.prompt_token_ids
    assert [(i.offset, i.num_tokens, i.layout, i.mm_hash, i.modality) for i in router.mm_items] == \
        [(i.offset, i.num_tokens, i.layout, i.mm_hash, i.modality) for i in engine.mm_items]
    assert all(i.pixel_values is None for i in router.mm_items)
    assert prompt_block_hashes(router, BLOCK) == prompt_block_hashes(engine, BLOCK)
    assert router.positions.equal(engine.positions)


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_gives_the_engines_hashes(procs, arch):
    proc = procs(arch)
    kinds = proc.modalities
    assert_same(proc, chat_prompt(proc, [{"type": "text", "text": "Only words here."}]))
    pictures = [{"type": "image_url", "image_url": {"url": picture_url(s)}} for s in (1, 2)]
    assert_same(proc, chat_prompt(proc, [pictures[0], {"type": "text", "text": "And this?"}, pictures[1]]))
    if "video" in kinds:
        clip = {"type": "video_url", "video_url": {"url": video_url(3)}}
        assert_same(proc, chat_prompt(proc, [pictures[0], clip, {"type": "text", "text": "Same scene?"}]))


def test_a_resent_picture_is_a_cache_lookup_and_settings_are_part_of_the_key(procs):
    proc = procs("qwen2_vl")
    cache = proc.processor.layouts
    prompt = chat_prompt(proc, [{"type": "image_url", "image_url": {"url": picture_url(5)}},
                                {"type": "text", "text": "Hi"}])
    first = proc.layout(prompt)
    hits, misses = cache.hits, cache.misses
    again = proc.layout(prompt)
    assert (cache.hits, cache.misses) == (hits + 1, misses)
    assert prompt_block_hashes(again, BLOCK) == prompt_block_hashes(first, BLOCK)
    # other resize bounds: another layout (fewer tokens) and hash, as the engine would make
    small = {"max_pixels": 56 * 56}
    other = proc.layout(prompt, small)
    assert cache.misses == misses + 1 and other.mm_items[0].num_tokens < first.mm_items[0].num_tokens
    assert prompt_block_hashes(other, BLOCK) == prompt_block_hashes(proc.process(fetched(prompt), small), BLOCK)
    # a client's uuid stands for the content: the engine's hash is the uuid's
    with_id = {**prompt, "multi_modal_uuids": {"image": ["pic-1"]}}
    assert prompt_block_hashes(proc.layout(with_id), BLOCK) == \
        prompt_block_hashes(proc.process(fetched(with_id)), BLOCK) != prompt_block_hashes(first, BLOCK)


def test_the_cache_is_bounded():
    from vlserve.model.families.processor import MediaItemCache

    cache = MediaItemCache(size=2)
    keys = [MediaItemCache.key("image", f"data:image/png;base64,{k}", {}) for k in "abc"]
    for k, value in zip(keys, "abc"):
        cache.get_or_make(k, lambda v=value: v)
    assert cache.get_or_make(keys[0], lambda: "again") == "again"  # the oldest went out
    assert MediaItemCache.key("image", "/some/path.png", {}) is None  # a path may change under its name
    assert MediaItemCache.key("image", b"x", {"a": 1}) != MediaItemCache.key("image", b"x", {"a": 2})


def test_prompt_hasher_gives_the_hashes_of_what_the_server_processes(tiny_ckpt):
    ckpt = tiny_ckpt("qwen2_vl")
    ns = build_parser().parse_args(["router", "--model", str(ckpt), "--block-size", str(BLOCK)])
    hasher = PromptHasher(options_from(ns, ROUTER))
    try:
        parts = [{"type": "image_url", "image_url": {"url": picture_url(9)}}, {"type": "text", "text": "What?"}]
        body = ChatCompletionRequest(model="m", messages=[{"role": "system", "content": "You answer briefly."},
                                                          {"role": "user", "content": parts}])
        engine = prompt_block_hashes(hasher.processor.process(fetched(chat_prompt(hasher.processor, parts))), BLOCK)
        # a picture not seen yet is not decoded on the request's path: the blocks before it, the rest made aside
        first, whole = asyncio.run(hasher.chat(body))
        assert 0 < len(first) < len(engine) and first == engine[:len(first)] and not whole
        deadline = time.monotonic() + 10
        while (hashes := asyncio.run(hasher.chat(body))[0]) != engine:
            assert time.monotonic() < deadline, "the picture's layout was never made"
            time.sleep(0.05)
        assert len(hashes) > 10
        bad_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGEgcGljdHVyZQ=="}}
        bad = ChatCompletionRequest(model="m", messages=[{"role": "system", "content": "You answer briefly."},
                                                         {"role": "user", "content": [bad_part]}])
        before = len(hasher.processor.text_before_media(chat_prompt(hasher.processor, [bad_part]))) // BLOCK
        for _ in range(2):  # not a picture: never more than the text before it; the replica says why
            assert len(asyncio.run(hasher.chat(bad))[0]) == before
            time.sleep(0.2)
    finally:
        hasher.close()


def test_with_a_lora_adapter_the_router_hashes_as_the_replica_does(tiny_ckpt):
    """A request naming a LoRA adapter: the router's hashes are the replica's for that adapter (its prefix cache
    keys blocks by adapter, and a tower adapter's pictures by adapter too), never the base model's; the blocks
    before an unseen picture too."""
    from vlserve.core.lora import AdapterRef
    from vlserve.lora.catalog import with_adapter

    ckpt = tiny_ckpt("qwen2_vl")
    ns = build_parser().parse_args(["router", "--model", str(ckpt), "--block-size", str(BLOCK)])
    hasher = PromptHasher(options_from(ns, ROUTER))
    try:
        parts = [{"type": "text", "text": "Look at this picture closely:"},
                 {"type": "image_url", "image_url": {"url": picture_url(11)}}, {"type": "text", "text": "What?"}]
        body = ChatCompletionRequest(model="towers", messages=[{"role": "system", "content": "You answer briefly."},
                                                               {"role": "user", "content": parts}])
        processed = hasher.processor.process(fetched(chat_prompt(hasher.processor, parts)))
        towers = AdapterRef("towers", "/a", "towers@0123456789abcdef", True)
        replica = prompt_block_hashes(with_adapter(processed, towers), BLOCK)
        assert replica[0] != prompt_block_hashes(processed, BLOCK)[0]
        first, whole = asyncio.run(hasher.chat(body, towers))  # the picture not laid out yet: the text before it
        assert 0 < len(first) < len(replica) and first == replica[:len(first)] and not whole
        deadline = time.monotonic() + 10
        while asyncio.run(hasher.chat(body, towers))[0] != replica:
            assert time.monotonic() < deadline, "the picture's layout was never made"
            time.sleep(0.05)
    finally:
        hasher.close()


def test_replicas_list_their_adapters_and_only_those_serving_one_take_its_requests():
    from vlserve.core.lora import AdapterRef
    from vlserve.disagg.registry import InstanceInfo
    from vlserve.router.replicas import Replica, ReplicaSet, parse_adapters

    card = {"id": "docs", "object": "model", "root": "/adapters/docs", "parent": "base",
            "lora": {"key": "docs@00ff", "towers": False}}
    text = ('{"object": "list", "data": [{"id": "base", "parent": null}, %s, {"id": "x", "parent": "base"}, '
            '{"id": 7, "parent": "base", "lora": {"key": "k", "towers": true}}, "junk"]}') % json.dumps(card)
    assert parse_adapters(text) == {"docs": AdapterRef("docs", "/adapters/docs", "docs@00ff", False)}
    assert parse_adapters("not json") == {} and parse_adapters('{"data": 3}') == {} and parse_adapters("[]") == {}

    replicas = ReplicaSet.__new__(ReplicaSet)  # the choice only: no registry, no scraping
    replicas.replicas, replicas.index = {}, None
    for name, served in (("a", {}), ("b", parse_adapters(text)), ("c", {})):
        r = replicas.replicas[name] = Replica(InstanceInfo(name, "serve", f"{name}:1", f"{name}:1"))
        r.adapters, r.answering = served, True
    replicas.index = type("NoIndex", (), {"num_blocks": staticmethod(lambda name: 0)})()
    assert [r.name for r in replicas.candidates()] == ["a", "b", "c"]
    assert [r.name for r in replicas.candidates(adapter="docs")] == ["b"]
    assert replicas.candidates(adapter="other") == []
    assert set(replicas.adapters()) == {"docs"}
    replicas.replicas["b"].answering = False  # a replica not answering lists nothing
    assert replicas.adapters() == {}
