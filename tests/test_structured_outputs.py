"""Structured outputs through the engine: a random tiny model cannot write valid JSON (or match a regex) by
chance, so every valid answer here is the grammar's doing. Also: batches that mix constrained and free rows,
n > 1, pictures, logprobs, stop strings, chunked prefill, preemption mid-JSON, bad specs, and a grammar that
fails inside the engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams, StructuredOutputsParams
from vlserve.core.errors import InvalidInputError
from vlserve.engine.sampler import TokenBitmask, _apply_token_bitmask
from vlserve.engine.structured.grammar import ascii_lark_regexes, ascii_regex, grammar_for

PROMPTS = ["Hello, how are you?", "def fibonacci(n):", "The quick brown fox", "three python one"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "member": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                   "maxItems": 4},
    },
    "required": ["name", "age", "member", "scores"],
    "additionalProperties": False,
}
RECEIPT = {
    "type": "object",
    "properties": {"cents": {"type": "integer", "minimum": 0, "maximum": 100000},
                   "currency": {"enum": ["EUR", "USD"]},
                   "items": {"type": "array", "maxItems": 2,
                             "items": {"type": "object", "properties": {"qty": {"type": "integer", "minimum": 1,
                                                                                "maximum": 5}},
                                       "required": ["qty"], "additionalProperties": False}}},
    "required": ["currency", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(autouse=True)
def pool_is_full_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_full(request.getfixturevalue("llm"))


def _texts(llm, prompts, params):
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def _json(schema, **kw):
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_unconstrained_model_writes_no_json(llm):
    """The premise of this file: without a grammar the random model's text is not JSON."""
    for text in _texts(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=40)):
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("schema", [PERSON, RECEIPT], ids=["person", "receipt"])
def test_json_schema_greedy_and_sampled(llm, schema):
    for params in (_json(schema, temperature=0), _json(schema, temperature=1.0, seed=3)):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            _valid(c.text, schema)
            assert " " not in c.text, "JSON is compact by default"


def test_property_order_follows_the_schema(llm):
    value = _valid(_texts(llm, PROMPTS[:1], _json(PERSON, temperature=0))[0], PERSON)
    assert list(value) == ["name", "age", "member", "scores"]


def test_json_with_free_whitespace_is_why_compact_is_the_default(llm):
    """With whitespace allowed the weak model spends its tokens on it: what finishes is valid, the rest rambles."""
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec), use_tqdm=False)
    for c in (o.outputs[0] for o in outs):
        if c.finish_reason == "stop":
            _valid(c.text, PERSON)
    assert any(re.search(r"\s", o.outputs[0].text) for o in outs)


def test_json_object(llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json_object": True})
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_regex_choice_and_grammars(llm):
    regex = r"[A-Z]{2}-[0-9]{3}(-x)?"
    for text in _texts(llm, PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=20,
                                                    structured_outputs={"regex": regex})):
        assert re.fullmatch(regex, text), text
    colours = ["red", "green", "dark blue"]
    for text in _texts(llm, PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                                                    structured_outputs={"choice": colours})):
        assert text in colours
    lark = 'start: "SELECT " COL " FROM t" ("; " | "")\nCOL: "a" | "b" | "c"'
    for text in _texts(llm, PROMPTS, SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                                                    structured_outputs={"grammar": lark})):
        assert re.fullmatch(r"SELECT [abc] FROM t(; )?", text), text
    gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
    for text in _texts(llm, PROMPTS, SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                                                    structured_outputs={"grammar": gbnf})):
        assert re.fullmatch(r"x=[0-9][0-9]?;", text), text


def test_mixed_batch_leaves_free_rows_alone(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _texts(llm, PROMPTS, free)
    mixed = [free, _json(PERSON, temperature=0), free, SamplingParams(max_tokens=9, structured_outputs={"regex": "[a-c]{9}"})]
    texts = _texts(llm, PROMPTS, mixed)
    assert texts[0] == alone[0] and texts[2] == alone[2]
    _valid(texts[1], PERSON)
    assert re.fullmatch("[a-c]{9}", texts[3])


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(PROMPTS[:1], _json(PERSON, temperature=1.0, seed=11, n=4), use_tqdm=False)[0]
    values = [_valid(c.text, PERSON) for c in out.outputs]
    assert len(values) == 4
    assert len({json.dumps(v) for v in values}) > 1, "seeded samples should differ"


def test_pictures_with_a_schema(llm):
    prompts = [{"prompt": f"{IMG} describe", "multi_modal_data": {"image": noise_image(64 + 8 * i, 48, i)}}
               for i in range(3)]
    for text in _texts(llm, prompts, _json(RECEIPT, temperature=0)):
        _valid(text, RECEIPT)


def test_logprobs_and_stop_strings(llm):
    params = _json(PERSON, temperature=0, logprobs=2)
    c = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry  # the sampled token is reported, masked alternatives may be too (raw logprobs)
    cut = _texts(llm, PROMPTS[:1], _json(PERSON, temperature=0, stop=['"age"']))[0]
    assert c.text.startswith(cut) and '"age"' not in cut and len(cut) < len(c.text)


def test_chunked_prefill_prefix_cache_and_preemption_keep_the_answer(path, llm):
    """A request preempted mid-JSON and recomputed keeps its matcher state: same text as an undisturbed run."""
    params = [_json(PERSON, temperature=0), _json(RECEIPT, temperature=1.0, seed=4),
              SamplingParams(max_tokens=30, seed=6, structured_outputs={"regex": "([a-z]{3} ){9}"}),
              _json(PERSON, temperature=0.9, seed=8)]
    long_prompts = [p * 6 for p in PROMPTS]
    want = _texts(llm, long_prompts, params)
    tight = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
    got = _texts(tight, long_prompts, params)
    assert tight.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to force preemptions"
    assert got == want
    assert _texts(tight, long_prompts, params) == want  # again, now from the prefix cache
    assert tight.get_metrics()["prefix_cache_hits_total"] > 0
    assert_pool_full(tight)


@pytest.mark.parametrize("spec, reason", [
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"grammar": "root ::= [unclosed"}, "grammar"),
    ({"choice": []}, "non-empty"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "format"),
    ({"jsonn": {}}, "unsupported field"),
    ({"json": "[" * 5000 + "]" * 5000}, "not valid JSON"),
    ({"grammar": "start: <[99999]>"}, "99999"),  # only the model's tokenizer can tell: checked with it offline
])
def test_bad_specs_are_refused_and_the_engine_goes_on(llm, spec, reason):
    with pytest.raises(InvalidInputError, match=re.escape(reason)):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, structured_outputs=spec), use_tqdm=False)
    assert _texts(llm, PROMPTS[:1], SamplingParams(max_tokens=3, structured_outputs={"choice": ["ok"]})) == ["ok"]


def test_grammar_failing_inside_the_engine_is_reported(llm):
    """A spec that skipped the front end's check fails when the engine builds it: refused, nothing leaks,
    the other requests finish."""
    engine = llm.engine
    bad = SamplingParams(max_tokens=5, n=2, structured_outputs={"regex": "x(y"})
    engine.core.add_request("bad", engine.input_processor.process(PROMPTS[0]), bad)
    engine.output_processor.add("bad", PROMPTS[0], [0], [("0_bad", bad), ("1_bad", bad)])
    good = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]{4}"}))
    errors, finished = [], {}
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        except InvalidInputError as e:
            errors.append(str(e))
    assert len(errors) == 1 and "unclosed group" in errors[0]
    assert re.fullmatch("[ab]{4}", finished[good].outputs[0].text)


def test_token_bitmask_matches_a_plain_loop():
    torch.manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(4, vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    mask = TokenBitmask([1, 3], bits)
    got = logits.clone()
    _apply_token_bitmask(got, mask)
    want = logits.clone()
    for i, row in enumerate(mask.rows):
        for t in range(vocab):
            if not (int(bits[i, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    assert torch.equal(got, want)


def test_a_matcher_for_a_request_with_output_replays_it(path):
    """A request resumed with output already generated (elsewhere) gets a matcher that has consumed it."""
    from transformers import AutoTokenizer

    from vlserve.engine.structured.matchers import GrammarMatchers

    tok = AutoTokenizer.from_pretrained(str(path))
    matchers = GrammarMatchers(path, (tok.eos_token_id,), 1024)
    spec = StructuredOutputsParams(regex="ab(cd)+")
    done = matchers.build(spec, tok.encode("abcd"))
    assert done.matcher.is_accepting()
    assert not matchers.build(spec, []).matcher.is_accepting()
    wrong = matchers.build(spec, tok.encode("xyz"))
    with pytest.raises(InvalidInputError, match="does not match its grammar"):
        wrong.matcher  # noqa: B018 - waits for the build
    assert "does not match its grammar" in wrong.error
    matchers.shutdown()


# \d \w \s and their complements, as vLLM's users read them (xgrammar, outlines, Python's re.ASCII); the grammar
# engine's own regex syntax (Rust's) makes them Unicode classes, where a random model finds "٣" or "߄" easily.
ASCII_CLASS_REGEXES = [r"\d{3}-\d{4}", r"\w{8}", r"[\d.]{6}", r"[^\D]{4}\W", r"\S{3}\s\S{3}", r"[^\d\s]{5}"]


@pytest.mark.parametrize("spec_of", [lambda p: {"regex": p}, lambda p: {"grammar": f'start: "<" T ">"\nT: /{p}/'}],
                         ids=["regex", "lark-terminal"])
def test_sampled_regex_classes_are_ascii(llm, spec_of):
    for pattern in ASCII_CLASS_REGEXES:
        want = pattern if "regex" in spec_of(pattern) else f"<{pattern}>"
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=spec_of(pattern))
                  for seed in range(16)]
        for out in llm.generate(["Phone:"] * len(params), params, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and re.fullmatch(want, c.text, re.ASCII), (pattern, c.text)


def test_json_schema_pattern_is_ecmascript(llm):
    """A schema's "pattern" follows ECMAScript (JSON Schema's dialect): \\d and \\w are ASCII there too."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{4}\w{3}$"}},
              "required": ["code"], "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"json": schema})
              for seed in range(16)]
    for out in llm.generate(["Code:"] * len(params), params, use_tqdm=False):
        assert re.fullmatch(r"\d{4}\w{3}", json.loads(out.outputs[0].text)["code"], re.ASCII), out.outputs[0].text


@pytest.fixture(scope="module")
def llg_tokenizer(path):
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, llguidance.hf.from_tokenizer(tok, eos_token=tok.eos_token_id)


CLASS_CASES = [r"\d+", r"\D+", r"\w+", r"\W+", r"\s+", r"\S+", r"[\d.]+", r"[^\d]+", r"[^\D]+", r"[\w-]+", r"[\W\d]+",
               r"[^\s\d]+", r"\\d", r"[\\d]+", r"\d{3}-\d{4}", r"(?:\w\s?)+"]
CLASS_TEXTS = ["123", "٣", "१२", "12٣", "０", "abc_Z9", "é", "ǃ", "K", " ", "\t\n\r\f\v", "\u00a0", "\u2003", "\u3000",
               "\u0085", "-", "a.b", "1.5", "\\d", "d", "\\", "x y", "123-4567", "١٢٣-٤٥٦٧", "a_1 b"]


@pytest.mark.parametrize("kind", ["regex", "grammar"])
@pytest.mark.parametrize("pattern", CLASS_CASES)
def test_regex_classes_admit_what_python_re_ascii_admits(llg_tokenizer, kind, pattern):
    """Whole texts the grammar admits == those Python's re.fullmatch(pattern, text, re.ASCII) admits."""
    import llguidance

    tok, llt = llg_tokenizer
    spec = StructuredOutputsParams(**{kind: pattern if kind == "regex" else f"start: /{pattern}/"})
    for text in CLASS_TEXTS:
        m = llguidance.LLMatcher(llt, grammar_for(spec))
        ids = tok.encode(text)
        admitted = m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
        assert admitted == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


def test_ascii_rewrite_of_regexes_and_lark_terminals():
    assert ascii_regex(r"\d{3}-\d{4}") == "[0-9]{3}-[0-9]{4}"
    assert ascii_regex(r"\\d\\\d") == r"\\d\\[0-9]"  # an escaped backslash, then d; then \\ and \d
    assert ascii_regex(r"[^\d.]\D") == "[^[0-9].][^0-9]"
    assert ascii_regex("a/b") == r"a\/b"  # ready for /.../
    with pytest.raises(ValueError, match="unfinished escape"):
        ascii_regex("ab\\")
    lark = r"""start: "\\d/\" # not a comment" A B C <|a/b\d|> # a comment /\d/
A: /[\d#\"]+\//i  // a comment /\w/
B: %json {"type": "string", "pattern": "^\\d/\\w$"}
C: /\\d\s/ | /\//"""
    assert ascii_lark_regexes(lark) == r"""start: "\\d/\" # not a comment" A B C <|a/b\d|> # a comment /\d/
A: /[[0-9]#\"]+\//i  // a comment /\w/
B: %json {"type": "string", "pattern": "^\\d/\\w$"}
C: /\\d[ \t\n\r\f\v]/ | /\//"""  # the %json pattern is ECMAScript's, left to the JSON compiler
    with pytest.raises(InvalidInputError, match="structured_outputs.regex cannot be compiled: .*unfinished escape"):
        grammar_for(StructuredOutputsParams(regex="12\\"))


def test_engine_shutdown_stops_the_grammar_threads(path):
    """Before, `EngineCore.shutdown()` left the grammar compile threads (and the mask worker) running."""
    core = LLM(path, dtype="float32", num_kv_blocks=32, block_size=8).engine.core
    threads = list(core.grammars._worker._threads)
    assert threads and all(t.is_alive() for t in threads)
    core.shutdown()
    for thread in threads:
        thread.join(5)  # each ends at once once told to
    assert not any(t.is_alive() for t in threads), "grammar compile threads outlived the engine"
    with pytest.raises(RuntimeError, match="shut down"):
        core.grammars.build(StructuredOutputsParams(regex="[a-z]+"), [], "late")
