import msgspec
import pytest

from vlserve.core.errors import InvalidInputError
from vlserve.core.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.greedy


def test_stop_normalised_to_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=("a",)).stop == ["a"]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (0.01, False), (2.0, False)])
def test_greedy_property(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_valid_edge_values():
    SamplingParams(
        n=3, temperature=0, top_p=1.0, top_k=1, min_p=1.0, max_tokens=None, min_tokens=100,
        presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01, logprobs=20,
    )
    SamplingParams(min_tokens=5, max_tokens=5, logprobs=0, top_p=1e-9)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"n": 0}, "n must"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_values_raise(kwargs, fragment):
    with pytest.raises(InvalidInputError, match=fragment):
        SamplingParams(**kwargs)


def test_invalid_input_is_value_error():
    with pytest.raises(ValueError):
        SamplingParams(n=0)


def test_msgspec_round_trip():
    p = SamplingParams(temperature=0.5, seed=7, stop="x", stop_token_ids=[3], logprobs=2)
    for enc, dec in ((msgspec.msgpack.encode, msgspec.msgpack.decode), (msgspec.json.encode, msgspec.json.decode)):
        assert dec(enc(p), type=SamplingParams) == p


def test_decoding_validates():
    # msgspec wraps the ValueError from __post_init__ into its ValidationError.
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
