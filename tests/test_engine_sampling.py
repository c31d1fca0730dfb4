"""Sampling parameters as seen through the whole engine (`LLM.generate`)."""

from __future__ import annotations

import pytest

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams

PROMPTS = ["Hello, how are you?", "def fibonacci(n):", "The quick brown fox"]
# Prompts whose greedy continuation on the tiny qwen2_vl checkpoint (seed 0) reaches EOS after 13-16 tokens;
# the test that needs one searches them, so a changed checkpoint fails loudly instead of silently passing.
EARLY_EOS_CANDIDATES = ["tuple is blue how python blue", "three python one", "three hello how blue cat",
                        "green is", "list cat is cat dog is", "one why green list green code", "what green"]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=128, block_size=8)


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """Greedy 24-token continuations of PROMPTS, computed once for the tests that compare against them."""
    return _greedy(llm, PROMPTS, 24)


@pytest.fixture(autouse=True)
def pool_is_full_after(llm):
    yield
    assert_pool_full(llm)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _greedy(llm, prompts, n=16):
    return _gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


# ---- seeds -----------------------------------------------------------------------------------------------
def test_same_seed_same_tokens_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _tokens(_gen(llm, [PROMPTS[0]], p))[0]
    # Companions: unseeded random rows (they consume the global RNG), greedy rows, another seed, a picture.
    companions = [
        (PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)),
        ({"prompt": f"{IMG} what?", "multi_modal_data": {"image": noise_image(60, 60, 3)}},
         SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=0.7, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)),
    ]
    batch = [companions[0], companions[1], (PROMPTS[0], p), companions[2]]
    outs = _gen(llm, [b[0] for b in batch], [b[1] for b in batch])
    assert outs[2].outputs[0].token_ids == alone
    batch = [(PROMPTS[0], p)] + companions
    outs = _gen(llm, [b[0] for b in batch], [b[1] for b in batch])
    assert outs[0].outputs[0].token_ids == alone


def test_different_seeds_differ(llm):
    outs = _gen(llm, [PROMPTS[0]] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)
                                        for s in (1, 2)])
    a, b = _tokens(outs)
    assert len(a) == len(b) == 16
    assert a != b


def test_random_sampling_without_seed_runs(llm):
    outs = _gen(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, max_tokens=8,
                                             ignore_eos=True))
    vocab = llm.config.model.text.vocab_size
    for o in outs:
        assert len(o.outputs[0].token_ids) == 8
        assert all(0 <= t < vocab for t in o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length"


def test_n_samples(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = _gen(llm, [PROMPTS[1]], p)
    assert len(first) == 1 and first[0].finished
    outs = first[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs)) > 1, "three seeded samples came out identical"
    # again, now next to requests with n=3 and no seed
    unseeded_p = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True)
    again, *unseeded = _gen(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [p, unseeded_p, unseeded_p])
    assert [tuple(o.token_ids) for o in again.outputs] == seqs
    for ro in unseeded:  # n without a seed still gives n complete outputs
        assert [o.index for o in ro.outputs] == [0, 1, 2]
        assert all(len(o.token_ids) == 4 for o in ro.outputs)


def test_n_greedy_samples_are_identical(llm, greedy_ref):
    out = _gen(llm, [PROMPTS[0]], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == greedy_ref[0].outputs[0].token_ids[:6]


# ---- stopping --------------------------------------------------------------------------------------------
def test_stop_token_ids(llm, greedy_ref):
    greedy = greedy_ref[2].outputs[0].token_ids[:16]
    pos = next(i for i in range(3, len(greedy)) if greedy[i] not in greedy[:i])
    stop_id = greedy[pos]
    out = _gen(llm, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == greedy[: pos + 1]


def test_stop_string_cuts_text(llm, greedy_ref):
    for o in greedy_ref:
        text = o.outputs[0].text
        # a plain substring well inside the text
        for start in range(4, len(text) - 3):
            stop = text[start : start + 3]
            if stop.isascii() and stop.isalpha():
                break
        else:
            continue
        idx = text.find(stop)
        out = _gen(llm, [o.prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop"
        assert out.stop_reason == stop
        assert out.text == text[:idx]
        assert len(out.token_ids) <= len(o.outputs[0].token_ids)
        # include_stop_str_in_output keeps it
        out = _gen(llm, [o.prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True))[0].outputs[0]
        assert out.text == text[: idx + len(stop)]
        return
    pytest.fail("no greedy output with a plain 3-letter substring to use as a stop string")


def _early_eos(llm):
    outs = _gen(llm, EARLY_EOS_CANDIDATES, SamplingParams(temperature=0.0, max_tokens=24))
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop" and len(c.token_ids) < 20:
            return o.prompt, c
    pytest.fail("none of the candidate prompts reaches EOS early any more; refresh EARLY_EOS_CANDIDATES")


def test_min_tokens_outlasts_eos(llm):
    prompt, early = _early_eos(llm)
    eos = set(llm.config.model.eos_token_ids)
    assert early.token_ids[-1] in eos and early.stop_reason is None
    n = len(early.token_ids)
    outs = _gen(llm, [prompt, prompt], [
        SamplingParams(temperature=0.0, max_tokens=n + 12, min_tokens=n + 4),
        # min_tokens also holds back stop_token_ids
        SamplingParams(temperature=0.0, max_tokens=n + 12, min_tokens=3, ignore_eos=True,
                       stop_token_ids=[early.token_ids[0]]),
    ])
    out = outs[0].outputs[0]
    assert len(out.token_ids) >= n + 4
    assert not eos & set(out.token_ids[: n + 3]), "EOS sampled before min_tokens"
    assert out.token_ids[: n - 1] == early.token_ids[:-1]  # identical until EOS would have come
    out = outs[1].outputs[0]
    assert len(out.token_ids) >= 3
    assert early.token_ids[0] not in out.token_ids[:2]


def test_max_tokens_length(llm, greedy_ref):
    lengths = [1, 5, 17]
    outs = _gen(llm, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    for o, n, ref in zip(outs, lengths, greedy_ref):
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].stop_reason is None
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids[:n]


# ---- logprobs --------------------------------------------------------------------------------------------
def test_logprobs(llm):
    temps = [0.0, 0.0, 1.0, 1.0]
    outs = _gen(llm, PROMPTS[:2] * 2, [SamplingParams(temperature=t, seed=3, max_tokens=6, ignore_eos=True,
                                                      logprobs=3) for t in temps])
    for o, temperature in zip(outs, temps):
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 6
        total = 0.0
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry
            assert 3 <= len(entry) <= 4  # the sampled token plus the top 3 (it may be one of them)
            lp = entry[tok]
            assert lp.logprob <= 0.0 and lp.rank >= 1
            if temperature == 0.0:
                assert lp.rank == 1
            assert {v.rank for t, v in entry.items() if t != tok} <= {1, 2, 3}
            assert all(v.logprob <= 0.0 and v.decoded_token is not None for v in entry.values())
            by_rank = sorted(entry.values(), key=lambda v: v.rank)
            assert all(a.logprob >= b.logprob - 1e-6 for a, b in zip(by_rank, by_rank[1:]))
            total += lp.logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_no_logprobs_by_default(llm):
    c = _greedy(llm, [PROMPTS[0]], 3)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


# ---- penalties -------------------------------------------------------------------------------------------
def test_penalties_change_greedy_output(llm, greedy_ref):
    base = _tokens(greedy_ref)
    penalties = [dict(presence_penalty=1.5), dict(frequency_penalty=1.5), dict(repetition_penalty=1.5),
                 dict(presence_penalty=-1.0)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in penalties]
    # one batch: every penalty on every prompt (rows with different penalties share the step)
    outs = _tokens(_gen(llm, PROMPTS * len(params), [p for p in params for _ in PROMPTS]))
    for k, kw in enumerate(penalties):
        pen = outs[k * len(PROMPTS) : (k + 1) * len(PROMPTS)]
        assert all(len(t) == 24 for t in pen)
        assert base != pen, f"{kw} changed nothing on any prompt"
    # and a penalty-free row batched with penalised ones is untouched
    mixed = _gen(llm, PROMPTS[:2], [params[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)])
    assert mixed[1].outputs[0].token_ids == base[1]
    assert mixed[0].outputs[0].token_ids == outs[0]


def test_seeded_sampling_survives_preemption_and_chunking(llm, tiny_ckpt):
    """Recompute after preemption and split prefills must not disturb a seeded request's random stream."""
    prompts = PROMPTS + [{"prompt": f"{IMG} and {IMG}?", "multi_modal_data": {"image": [noise_image(90, 60, 5),
                                                                                       noise_image(60, 90, 6)]}}]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=20, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    params.append(SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=20, ignore_eos=True))
    prompts.append(PROMPTS[0])
    roomy = _gen(llm, prompts, params)
    tight = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=24, block_size=4,
                max_num_batched_tokens=8)
    cramped = _gen(tight, prompts, params)
    assert tight.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to force preemptions"
    for a, b in zip(roomy, cramped):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for a, b in zip(roomy[:-1], cramped[:-1]):
        la = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert la == pytest.approx(lb, abs=1e-4)
    assert_pool_full(tight)
