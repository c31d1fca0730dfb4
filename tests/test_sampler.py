import math

import pytest
import torch

from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.sampler import Sampler, SamplingMetadata

V = 50
EOS = 7


def build(params, logits_rows=None, outputs=None, prompts=None, eos=None, seeds=None):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    eos = eos if eos is not None else [{EOS} for _ in range(n)]
    gens = {}
    for i, p in enumerate(params):
        if p.seed is not None:
            gens[i] = torch.Generator().manual_seed(p.seed)
    return SamplingMetadata.build(params, outputs, prompts, eos, gens, "cpu")


def sample(logits, params, **kw):
    return Sampler()(logits, build(params, **kw))


def rand_logits(b, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_build_leaves_unused_features_none():
    meta = build([SamplingParams(), SamplingParams(temperature=0)])
    assert meta.top_k is meta.top_p is meta.min_p is None
    assert meta.presence_penalty is meta.frequency_penalty is meta.repetition_penalty is None
    assert meta.prompt_token_ids is None and meta.max_num_logprobs is None
    assert meta.min_tokens_blocked == {}
    assert not meta.all_greedy and not meta.all_random
    assert meta.temperature.tolist() == [1.0, 0.0]


def test_build_drops_generators_of_greedy_rows():
    meta = build([SamplingParams(temperature=0, seed=1), SamplingParams(seed=2)])
    assert list(meta.generators) == [1]


def test_greedy_is_argmax():
    logits = rand_logits(4)
    out = sample(logits, [SamplingParams(temperature=0)] * 4)
    assert torch.equal(out.sampled, logits.argmax(-1))
    assert out.logprobs is None and out.sampled_ranks is None


def test_bf16_input():
    logits = rand_logits(3).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0)] * 3)
    assert out.sampled.dtype == torch.int64
    assert torch.equal(out.sampled, logits.float().argmax(-1))


def test_input_logits_not_modified():
    logits = rand_logits(2)
    before = logits.clone()
    sample(logits, [SamplingParams(top_k=3, presence_penalty=1.0)] * 2, outputs=[[1, 2], [3]])
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy():
    logits = rand_logits(6)
    torch.manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6)
    assert torch.equal(out.sampled, logits.argmax(-1))


def test_tiny_top_p_is_argmax():
    logits = rand_logits(6)
    out = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 6)
    assert torch.equal(out.sampled, logits.argmax(-1))


def test_top_k_restricts_support():
    logits = rand_logits(1).repeat(200, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 200)
    assert set(out.sampled.tolist()) <= allowed
    assert len(set(out.sampled.tolist())) > 1


def test_top_p_keeps_smallest_nucleus():
    # probs 0.5, 0.3, 0.2: p=0.7 keeps the first two (0.5 < 0.7, 0.8 >= 0.7).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(500, 1)
    out = sample(logits, [SamplingParams(top_p=0.7)] * 500)
    assert set(out.sampled.tolist()) == {0, 1}


def test_min_p_masks_unlikely_tokens():
    # probs 0.6, 0.3, 0.1; min_p 0.4 -> threshold 0.24 drops token 2.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(500, 1)
    out = sample(logits, [SamplingParams(min_p=0.4)] * 500)
    assert set(out.sampled.tolist()) == {0, 1}


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(1, seed=3).repeat(8, 1) / 10  # flat: random rows vary
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=i) for i in range(8)]
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    out = Sampler()(logits, meta)
    argmax = logits[0].argmax().item()
    assert all(t == argmax for t in out.sampled[0::2].tolist())
    assert any(t != argmax for t in out.sampled[1::2].tolist())


def test_seed_reproducible_across_batch_composition():
    target = rand_logits(1, seed=11)[0] / 5
    steps = 5

    def run(batch_size, position, others_seeded):
        params = [SamplingParams(seed=100 + i) if others_seeded else SamplingParams() for i in range(batch_size)]
        params[position] = SamplingParams(seed=1234, top_k=20, top_p=0.95)
        gens = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}
        tokens = []
        for step in range(steps):
            logits = rand_logits(batch_size, seed=step)
            logits[position] = target
            meta = SamplingMetadata.build(params, [[]] * batch_size, [[]] * batch_size, [{EOS}] * batch_size, gens, "cpu")
            tokens.append(Sampler()(logits, meta).sampled[position].item())
        return tokens

    ref = run(1, 0, False)
    assert run(4, 2, False) == ref
    assert run(7, 6, True) == ref
    assert run(3, 0, True) == ref


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens
    a = [sample(logits, [SamplingParams(seed=s)]).sampled.item() for s in range(10)]
    assert len(set(a)) > 5


def test_sampling_follows_softmax():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000
    logits = (torch.log(probs) * 2.0).repeat(n, 1)  # temperature 2 undoes the *2
    out = sample(logits, [SamplingParams(temperature=2.0)] * n)
    freq = torch.bincount(out.sampled, minlength=3).float() / n
    # 4 sigma of a binomial with p=0.6 and n=4000 is about 0.031.
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_sampling_follows_softmax():
    probs = torch.tensor([0.2, 0.5, 0.3])
    logits = torch.log(probs).unsqueeze(0)
    meta_params = [SamplingParams(seed=5)]
    gens = {0: torch.Generator().manual_seed(5)}
    counts = torch.zeros(3)
    for _ in range(2000):
        meta = SamplingMetadata.build(meta_params, [[]], [[]], [{EOS}], gens, "cpu")
        counts[Sampler()(logits, meta).sampled.item()] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04), counts


def test_repetition_penalty_numbers():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    meta = build(params, prompts=[[0, 1]], outputs=[[2, 2]])
    from vlserve.engine.sampler import _apply_penalties
    out = logits.clone()
    _apply_penalties(out, meta)
    assert out.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5]]


def test_frequency_and_presence_penalty_numbers():
    from vlserve.engine.sampler import _apply_penalties
    logits = torch.zeros(2, 5)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(frequency_penalty=-1.0),
    ]
    # Prompt tokens do not count for frequency/presence.
    meta = build(params, prompts=[[4, 4], [4]], outputs=[[1, 1, 1, 3], [0, 0]])
    _apply_penalties(logits, meta)
    assert logits.tolist() == [
        [0.0, -(0.5 * 3 + 1.0), 0.0, -(0.5 + 1.0), 0.0],
        [2.0, 0.0, 0.0, 0.0, 0.0],
    ]


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0, frequency_penalty=2.0)], outputs=[[0]])
    assert out.sampled.item() == 1


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((2, V), -5.0)
    logits[:, EOS] = 10.0
    logits[:, 3] = 9.0
    logits[:, 4] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])] * 2
    meta = build(params, outputs=[[1], [1, 2]])  # row 1 already has 2 tokens
    assert meta.min_tokens_blocked == {0: [3, EOS]}
    out = Sampler()(logits, meta)
    assert out.sampled.tolist() == [4, EOS]


def test_min_tokens_with_ignore_eos_leaves_eos():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)]
    meta = build(params, outputs=[[]])
    assert meta.min_tokens_blocked == {0: [3]}
    assert Sampler()(logits, meta).sampled.item() == EOS


def test_min_tokens_multiple_eos_ids():
    logits = torch.zeros(1, V)
    logits[0, 1] = 3.0
    logits[0, 2] = 2.0
    logits[0, 5] = 1.0
    meta = build([SamplingParams(temperature=0, min_tokens=1)], eos=[[1, 2]])
    assert Sampler()(logits, meta).sampled.item() == 5


def test_logprobs_shape_and_values():
    logits = rand_logits(3)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(logprobs=5), SamplingParams()]
    out = sample(logits, params)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.shape == (3, 6) and out.logprob_token_ids.shape == (3, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.sampled[:, None])[:, 0])
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert out.sampled_ranks[0].item() == 1  # greedy row sampled the top token
    expected_ranks = (raw > raw.gather(1, out.sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_ranks)


def test_logprobs_are_raw_before_penalties_and_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=0, frequency_penalty=2.0)]
    out = sample(logits, params, outputs=[[0, 0]])
    assert out.sampled.item() == 1  # penalties changed the choice ...
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.shape == (1, 1)
    assert math.isclose(out.logprobs[0, 0].item(), raw[0, 1].item(), rel_tol=1e-6)  # ... not the logprob
    assert out.sampled_ranks.item() == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_device():
    logits = rand_logits(4).cuda()
    params = [SamplingParams(temperature=0), SamplingParams(seed=3, top_k=5, top_p=0.9, min_p=0.05, logprobs=3),
              SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2), SamplingParams()]
    gens = {1: torch.Generator(device="cuda").manual_seed(3)}
    meta = SamplingMetadata.build(params, [[1], [2], [3, 3], []], [[4], [5], [6], [7]], [{EOS}] * 4, gens, "cuda")
    out = Sampler()(logits, meta)
    assert out.sampled.device.type == "cuda" and out.logprobs.device.type == "cuda"
    assert out.sampled[0].item() == logits[0].argmax().item()
