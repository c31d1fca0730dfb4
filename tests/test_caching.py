"""Prefix caching and the encoder cache: hits are counted right, reuse exactly what may be reused, and never
change an output; eviction under pressure leaks neither KV blocks nor encoder tensors."""

from __future__ import annotations

import base64
import io
import random
import threading

import pytest

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.engine_probes import metric_delta
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.engine.block_pool import BlockPool

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARCH = "qwen2_vl"


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt(ARCH)


@pytest.fixture(scope="module")
def llm(path):
    """One shared caching engine for the tests that only look at metric deltas."""
    return LLM(path, dtype="float32", num_kv_blocks=256)


def _req(text, imgs=(), uuids=None):
    if not imgs:
        return text
    p = {"prompt": text, "multi_modal_data": {"image": list(imgs)}}
    if uuids is not None:
        p["multi_modal_uuids"] = {"image": list(uuids)}
    return p


def _gen(llm, prompts, **kw):
    prompts = prompts if isinstance(prompts, list) else [prompts]
    return llm.generate(prompts, GREEDY, use_tqdm=False, **kw)


def _metrics(llm):
    return dict(llm.get_metrics())


def _image_offset(llm, out):
    return out.prompt_token_ids.index(llm.config.model.image_token_id)


def _num_image_tokens(llm, out):
    return out.prompt_token_ids.count(llm.config.model.image_token_id)


def _hashes_in_cache(llm):
    return set(llm.engine.core.scheduler.encoder_cache._size)


def _flush_and_check_no_leak(llm):
    """Freed encoder keys reach the runner at the next step: run one empty step, then compare."""
    llm.engine.core.step()
    runner_keys = set(llm.engine.core.runner.encoders.outputs)
    assert runner_keys <= _hashes_in_cache(llm), "the runner holds encoder outputs the cache forgot"
    assert_pool_full(llm)


def _count_encodes(llm):
    """Wrap the runner's encoder call; returns a list that collects the mm_hash of every encoded item."""
    vision = llm.engine.core.runner.encoders
    encoded: list[str] = []
    orig = vision.encode

    def encode(items):
        encoded.extend(it.mm_hash for it in items)
        return orig(items)

    vision.encode = encode
    return encoded


def _png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---- 1-3: what is reused --------------------------------------------------------------------------------------
def test_same_text_same_picture_reuses(llm):
    prompt = _req(f"Same text, same picture: {IMG} what is it?", [noise_image(120, 90, 101)])
    before = _metrics(llm)
    (first,) = _gen(llm, prompt)
    mid = _metrics(llm)
    (second,) = _gen(llm, prompt)
    after = _metrics(llm)
    d1, d2 = metric_delta(before, mid), metric_delta(mid, after)
    assert d1["encoder_cache_hits_total"] == 0 and d1["encoder_cache_queries_total"] == 1
    n = len(second.prompt_token_ids)
    bs = llm.config.block_size
    assert d2["prefix_cache_queries_total"] == n
    covered = d2["prefix_cache_hits_total"] >= n - bs
    assert covered or d2["encoder_cache_hits_total"] == 1
    assert covered, f"only {d2['prefix_cache_hits_total']} of {n} prompt tokens were reused"
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.prompt_token_ids == first.prompt_token_ids
    _flush_and_check_no_leak(llm)


def test_same_text_different_picture_reuses_only_text_before_it(llm):
    text = "A fairly long common preamble that spans a few blocks of tokens before the picture: " + IMG + " ok"
    before = _metrics(llm)
    (a,) = _gen(llm, _req(text, [noise_image(120, 90, 201)]))
    mid = _metrics(llm)
    (b,) = _gen(llm, _req(text, [noise_image(120, 90, 202)]))
    after = _metrics(llm)
    bs = llm.config.block_size
    offset = _image_offset(llm, b)
    assert offset == _image_offset(llm, a) and offset >= bs, "the preamble should fill at least one block"
    d = metric_delta(mid, after)
    assert d["prefix_cache_hits_total"] == (offset // bs) * bs
    assert d["encoder_cache_hits_total"] == 0 and d["encoder_cache_queries_total"] == 1
    assert metric_delta(before, mid)["encoder_cache_hits_total"] == 0
    _flush_and_check_no_leak(llm)


def test_different_text_same_picture_hits_encoder_only(llm):
    img = noise_image(120, 90, 301)
    (a,) = _gen(llm, _req(f"Common start. First question text here, long enough {IMG}", [img]))
    before = _metrics(llm)
    encoded = _count_encodes(llm)
    try:
        (b,) = _gen(llm, _req(f"Common start. Another question, very different words {IMG}", [img]))
    finally:
        del llm.engine.core.runner.encoders.encode
    d = metric_delta(before, _metrics(llm))
    assert d["encoder_cache_hits_total"] == 1 and d["encoder_cache_queries_total"] == 1
    assert encoded == [], "a hit must skip the vision encoder"
    common = 0
    while a.prompt_token_ids[common] == b.prompt_token_ids[common]:
        common += 1
    bs = llm.config.block_size
    assert common < _image_offset(llm, b)
    assert d["prefix_cache_hits_total"] <= (common // bs) * bs
    _flush_and_check_no_leak(llm)


# ---- 4: the hash ----------------------------------------------------------------------------------------------
def test_same_picture_in_every_form_hits_one_entry(llm, tmp_path):
    img = noise_image(120, 90, 401)
    png = _png_bytes(img)
    file = tmp_path / "pic.png"
    file.write_bytes(png)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    proc = llm.engine.input_processor
    forms = [img, png, data_url, str(file), file]
    hashes = []
    for i, src in enumerate(forms):
        req = proc.process({"prompt": f"x {IMG}", "multi_modal_data": {"image": [src]}})
        hashes.append(req.mm_items[0].mm_hash)
    assert len(set(hashes)) == 1, hashes

    before = _metrics(llm)
    _gen(llm, [_req(f"Form {i}: {IMG}", [src]) for i, src in enumerate(forms)])
    d = metric_delta(before, _metrics(llm))
    assert d["encoder_cache_queries_total"] == len(forms)
    assert d["encoder_cache_hits_total"] == len(forms) - 1
    assert hashes[0] in _hashes_in_cache(llm)

    # Other pixel limits change the preprocessing, hence the hash: a miss.
    kw = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 8}
    req = proc.process({"prompt": f"x {IMG}", "multi_modal_data": {"image": [img]}}, kw)
    assert req.mm_items[0].mm_hash != hashes[0]
    before = _metrics(llm)
    _gen(llm, _req(f"Form 0: {IMG}", [img]), mm_processor_kwargs=kw)
    d = metric_delta(before, _metrics(llm))
    assert d["encoder_cache_queries_total"] == 1 and d["encoder_cache_hits_total"] == 0
    _flush_and_check_no_leak(llm)


# ---- 5: a hit never changes an output ---------------------------------------------------------------------------
def _mixed_batch():
    p1, p2, p3 = noise_image(120, 90, 501), noise_image(90, 120, 502), noise_image(64, 64, 503)
    pre = "You are a careful assistant. Look at the picture and answer briefly. "
    return [
        _req(pre + f"{IMG} What is it?", [p1]),
        _req(pre + f"{IMG} What is it?", [p2]),
        _req(pre + f"{IMG} Describe the colours.", [p1]),
        _req(f"Different start {IMG} and {IMG}", [p2, p3]),
        _req(pre + "No picture at all here."),
        _req(pre + f"{IMG} What is it?", [p1]),
        _req(f"{IMG} {IMG} same twice", [p3, p3]),
        _req(pre + f"Two: {IMG} then {IMG}", [p1, p2]),
    ]


def _ids(outs):
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]


def test_hits_never_change_outputs(path):
    plain = LLM(path, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, encoder_cache_size=0)
    expected = _ids(_gen(plain, _mixed_batch()))
    _flush_and_check_no_leak(plain)
    assert plain.engine.core.runner.encoders.outputs == {}

    cached = LLM(path, dtype="float32", num_kv_blocks=256)
    assert _ids(_gen(cached, _mixed_batch())) == expected
    # within one batch all prompts are admitted in the same step, before any block is computed: only the
    # encoder cache can hit (the same picture shared by running requests)
    assert _metrics(cached)["encoder_cache_hits_total"] > 0
    # second round: everything is warm now, still identical
    assert _ids(_gen(cached, _mixed_batch())) == expected
    m = _metrics(cached)
    assert m["prefix_cache_hits_total"] > 0
    # interleaved with a reversed order
    assert _ids(_gen(cached, _mixed_batch()[::-1])) == expected[::-1]
    _flush_and_check_no_leak(cached)


# ---- 6: eviction under pressure ------------------------------------------------------------------------------
def test_eviction_under_pressure(path):
    pics = [noise_image(120, 90, 600 + i) for i in range(6)]
    prompts = [_req(f"Request {i}: look at {IMG} and answer", [pics[i % 6]]) for i in range(12)]
    plain = LLM(path, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, encoder_cache_size=0)
    expected = _ids(_gen(plain, prompts))
    n_img = _num_image_tokens(plain, _gen(plain, prompts[0])[0])
    assert n_img > 0

    llm = LLM(path, dtype="float32", num_kv_blocks=48, block_size=4, encoder_cache_size=n_img)
    assert _ids(_gen(llm, prompts)) == expected
    m = _metrics(llm)
    assert m["num_preemptions_total"] > 0, "the KV pool was meant to be too small for all requests at once"
    misses = m["encoder_cache_queries_total"] - m["encoder_cache_hits_total"]
    assert misses > len(pics), "with room for one picture, some pictures must have been evicted and re-encoded"
    sched = llm.engine.core.scheduler
    assert sched.encoder_cache.used <= sched.encoder_cache.capacity
    assert len(sched.encoder_cache) <= 1
    _flush_and_check_no_leak(llm)
    # and once more, everything warm where it survived
    assert _ids(_gen(llm, prompts)) == expected
    _flush_and_check_no_leak(llm)


# ---- 7, 8: limits ----------------------------------------------------------------------------------------------
def test_item_larger_than_encoder_cache_is_refused(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=256, encoder_cache_size=4)
    result = {}

    def run():
        try:
            _gen(llm, _req(f"Too big {IMG}", [noise_image(120, 90, 701)]))
            result["ok"] = True
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "an item that can never fit must be refused, not wait forever"
    assert isinstance(result.get("error"), InvalidInputError), result
    assert "encoder_cache_size" in str(result["error"])
    # still serving: text, and a picture small enough (56x56 -> 4 tokens)
    (out,) = _gen(llm, "Still alive?")
    assert len(out.outputs[0].token_ids) == 8
    (out,) = _gen(llm, _req(f"Small {IMG}", [noise_image(56, 56, 702)]))
    assert len(out.outputs[0].token_ids) == 8
    _flush_and_check_no_leak(llm)


def test_encoder_cache_size_zero(path):
    img = noise_image(120, 90, 801)
    prompts = [_req(f"Zero cache {IMG} one", [img]), _req(f"Zero cache {IMG} two", [noise_image(90, 90, 802)])]
    ref = LLM(path, dtype="float32", num_kv_blocks=256)
    expected = _ids(_gen(ref, prompts))

    llm = LLM(path, dtype="float32", num_kv_blocks=256, encoder_cache_size=0, enable_prefix_caching=False)
    before = _metrics(llm)
    assert _ids(_gen(llm, prompts)) == expected
    assert _ids(_gen(llm, prompts)) == expected  # sequential repeat: no entry survived between calls
    d = metric_delta(before, _metrics(llm))
    assert d["encoder_cache_hits_total"] == 0
    llm.engine.core.step()
    assert llm.engine.core.runner.encoders.outputs == {}
    assert len(llm.engine.core.scheduler.encoder_cache) == 0
    _flush_and_check_no_leak(llm)


# ---- 9: uuids ------------------------------------------------------------------------------------------------
def test_same_uuid_means_same_item(llm):
    before = _metrics(llm)
    _gen(llm, _req(f"Uuid test {IMG}", [noise_image(120, 90, 901)], uuids=["pic-42"]))
    mid = _metrics(llm)
    _gen(llm, _req(f"Uuid test, other words {IMG}", [noise_image(120, 90, 902)], uuids=["pic-42"]))
    d1, d2 = metric_delta(before, mid), metric_delta(mid, _metrics(llm))
    assert d1["encoder_cache_hits_total"] == 0
    assert d2["encoder_cache_hits_total"] == 1 and d2["encoder_cache_queries_total"] == 1
    _flush_and_check_no_leak(llm)


# ---- 10: BlockPool units -------------------------------------------------------------------------------------
def test_block_pool_lookup_checks_content():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    key = (b"root", (1, 2, 3, 4), ())
    pool.cache(b, b"h1", key)
    assert pool.lookup(b"h1", key) == b
    assert pool.lookup(b"h1", (b"root", (1, 2, 3, 5), ())) is None  # same hash, other content: miss
    assert pool.lookup(b"h2", key) is None
    pool.free([b])
    assert pool.lookup(b"h1", key) == b  # freed blocks stay cached
    pool.check_integrity()


def test_block_pool_eviction_on_allocate():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha", ("ka",))
    pool.cache(b, b"hb", ("kb",))
    pool.free([a, b])  # reverse order: b is freed first, so it is reused first
    assert pool.num_cached == 2
    (c,) = pool.allocate(1)
    assert c == b
    assert pool.lookup(b"hb", ("kb",)) is None and pool.lookup(b"ha", ("ka",)) == a
    assert pool.num_cached == 1
    pool.check_integrity()


def test_block_pool_touch_takes_idle_block_off_free_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, b"ha", ("ka",))
    pool.free([a])
    assert pool.num_free == 3
    pool.touch([pool.lookup(b"ha", ("ka",))])
    assert pool.num_free == 2 and pool.ref_counts[a] == 1
    assert a not in pool.allocate(2)
    assert pool.lookup(b"ha", ("ka",)) == a
    pool.touch([a])
    assert pool.ref_counts[a] == 2
    pool.free([a])
    pool.free([a])
    assert pool.ref_counts[a] == 0
    with pytest.raises(RuntimeError):
        pool.free([a])
    pool.check_integrity()


def test_block_pool_random_operations_keep_integrity():
    rng = random.Random(1234)
    pool = BlockPool(16)
    held: list[list[int]] = []
    n_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            blocks = pool.allocate(rng.randint(1, min(4, pool.num_free)))
            for b in blocks:
                if rng.random() < 0.6:
                    n_hash += 1
                    pool.cache(b, f"h{n_hash % 40}".encode(), (n_hash % 40,))
            held.append(blocks)
        elif op < 0.6:
            h = rng.randrange(40)
            b = pool.lookup(f"h{h}".encode(), (h,))
            if b is not None:
                if pool.ref_counts[b] == 0 or rng.random() < 0.5:
                    pool.touch([b])
                    held.append([b])
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        pool.check_integrity()
        assert sum(pool.ref_counts) == sum(len(h) for h in held)
    for blocks in held:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
