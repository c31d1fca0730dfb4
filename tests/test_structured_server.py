"""Structured outputs and tool calls through `vlserve serve` and the official openai client: schema-valid
`response_format` answers and valid `tool_calls`, streaming and not, pictures in the prompt and inside tool
results, the offline API's answers token for token, and a clear 400 (server unharmed) for every bad spec."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import noise_image
from tests.server_utils import RemoteServer
from tests.test_server_api import data_url, image_part, user
from tests.test_structured_outputs import PERSON
from tests.test_tool_calls import TOOLS, WEATHER
from vlserve import LLM, SamplingParams
from vlserve.server.demo import demo_image


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return str(tiny_ckpt("qwen2_vl"))


@pytest.fixture(scope="module")
def server(model):
    with RemoteServer(model, "--dtype", "float32", "--max-model-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


def _person_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def _chat(client, model, **kw):
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", user("Who is it?"))
    return client.chat.completions.create(model=model, **kw)


def test_response_format_json_schema_matches_offline(client, model, server):
    picture = user(image_part(data_url(noise_image(64, 48, 1))), "Fill in the form.")
    resp = _chat(client, model, messages=picture, response_format=_person_format())
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    offline = LLM(model, dtype="float32", max_model_len=2048)
    want = offline.chat(picture, SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": PERSON}),
                        use_tqdm=False)[0].outputs[0].text
    assert text == want


def test_response_format_streamed_and_n(client, model):
    stream = _chat(client, model, response_format=_person_format(False), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    resp = _chat(client, model, response_format=_person_format(), n=3, temperature=1.0, seed=7)
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_parse_helper_of_the_official_client(client, model):
    class Person(pydantic.BaseModel):
        name: Literal["ann", "bob"]
        adult: bool
        rank: Literal[1, 2, 3]

    resp = client.chat.completions.parse(model=model, messages=user("Who?"), response_format=Person, max_tokens=60,
                                         temperature=0)
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person)


def test_json_object_and_vllm_fields(client, model):
    resp = _chat(client, model, response_format={"type": "json_object"}, max_tokens=30)
    assert resp.choices[0].message.content.startswith("{")
    for body, check in [
        ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "n=" [1-9]'}}, lambda t: re.fullmatch("n=[1-9]", t)),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ]:
        text = _chat(client, model, extra_body=body).choices[0].message.content
        assert check(text), (body, text)
    resp = client.completions.create(model=model, prompt="Answer:", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert resp.choices[0].text in ("left", "right")


def _check_call(call, tools=TOOLS):
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls(client, model, tool_choice):
    resp = _chat(client, model, tools=TOOLS, tool_choice=tool_choice)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    if isinstance(tool_choice, dict):
        assert {c.function.name for c in choice.message.tool_calls} == {"get_weather"}


def test_forced_tool_calls_streamed_equal_the_whole_answer(client, model):
    whole = _chat(client, model, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in _chat(client, model, tools=TOOLS, tool_choice="required", stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_auto_and_none_and_a_conversation_with_tool_results(client, model):
    resp = _chat(client, model, tools=TOOLS, tool_choice="auto", max_tokens=20)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = [
        {"role": "user", "content": "Weather in Oslo, and show me the radar."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [
            {"type": "text", "text": "Rain. Radar image:"}, image_part(data_url(noise_image(64, 64, 9)))]},
    ]
    with_picture = _chat(client, model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5)
    without = _chat(client, model, messages=history[:2] + [{"role": "tool", "tool_call_id": "call_1",
                                                            "content": "Rain."}], tools=TOOLS, tool_choice="none",
                    max_tokens=5)
    assert with_picture.usage.prompt_tokens > without.usage.prompt_tokens + 10  # the picture's tokens are in
    assert with_picture.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "nope"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}}}, "schema"),
    ({"structured_outputs": {"regex": "(("}}, "regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "nothing_here"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "one output constraint"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, "missing"),
    ({"functions": [{"name": "f"}]}, "not supported"),
])
def test_bad_specs_get_400_and_the_server_goes_on(server, client, model, body, message):
    resp = server.post("/v1/chat/completions", json={"model": model, "messages": user("hi"), "max_tokens": 5, **body})
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]["message"]
    again = _chat(client, model, response_format={"type": "json_object"}, max_tokens=3)  # same connection pool
    assert again.choices[0].message.content.startswith("{")


def test_chat_template_flag_replaces_the_checkpoints(model, tmp_path):
    """`--chat-template FILE`: here a template with a tools section, which then renders the tools itself."""
    template = tmp_path / "tools.jinja"
    template.write_text("{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                        "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant")
    with RemoteServer(model, "--dtype", "float32", "--chat-template", str(template)) as s:
        c = s.client(timeout=60)
        plain = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "abc"}], max_tokens=1)
        tools = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "abc"}], max_tokens=1,
                                          tools=[WEATHER])
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens
    offline = LLM(model, dtype="float32")
    n = len(offline.get_tokenizer().encode("<get_weather>abc<|im_start|>assistant"))
    assert tools.usage.prompt_tokens == n


def test_bad_chat_template_flag_fails_at_start(model):
    with pytest.raises(RuntimeError, match="neither a file nor a Jinja template"):
        RemoteServer(model, "--chat-template", "/no/such/template.jinja", timeout=60)


def test_openai_error_type(client, model):
    with pytest.raises(openai.BadRequestError):
        _chat(client, model, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})


def _post_either(server, model, route: str, body: dict):
    where = {"messages": user("hi")} if route.endswith("chat/completions") else {"prompt": "hi"}
    return server.post(route, json={"model": model, "max_tokens": 5, **where, **body})


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema cannot be compiled"),
    ({"guided_json": {"$ref": "#/nope"}}, "guided_json cannot be compiled"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_regex": "(("}, "guided_regex cannot be compiled"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
    ({"structured_outputs": {"json": {"$ref": "#/nope"}}}, "structured_outputs.json cannot be compiled"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex cannot be compiled"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar must be a non-empty string"),
    ({"structured_outputs": {"json": {"$ref": "#/nope"}}, "response_format": {"type": "text"}},
     "structured_outputs.json cannot be compiled"),
])
def test_a_bad_constraint_is_reported_under_the_field_the_client_sent(server, model, route, body, field):
    resp = _post_either(server, model, route, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(field), resp.json()["error"]["message"]


def test_a_tool_whose_parameters_cannot_compile_is_named(server, model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/missing"}}}]
    resp = _post_either(server, model, "/v1/chat/completions", {"tools": tools, "tool_choice": "required"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("tools[].function.parameters cannot be compiled: ")


# docs/serving.md's example, as written there (test_the_docs_examples_are_the_ones_tested_here reads it; the docs'
# blocks themselves run in tests/test_doc_snippets_run.py). Its bounds keep the worst answer within max_tokens=200:
# a random model writes the string until the limit otherwise, and the JSON comes back cut (LengthFinishReasonError).
class Receipt(pydantic.BaseModel):
    shop: str = pydantic.Field(max_length=20)
    total_cents: int = pydantic.Field(ge=0, le=10_000_000)
    paid_by_card: bool


SERVING_DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def demo_model(tiny_ckpt):
    return str(tiny_ckpt("qwen2_vl", "small"))  # what `vlserve serve` without --model makes: the same weights


def _docs_python_block(marker: str) -> str:
    """The ```python block of docs/serving.md that holds `marker`."""
    blocks = re.findall(r"^```python\n(.*?)^```$", SERVING_DOC.read_text(), re.DOTALL | re.MULTILINE)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/serving.md: {len(found)} python blocks hold {marker!r}"
    return found[0]


def _docs_tools() -> list:
    """The `tools` of docs/serving.md's tool-calling example, evaluated."""
    code = _docs_python_block('tool_choice="required"')
    start = code.index("tools = [")
    namespace: dict = {}
    exec(code[start:code.index("\nresp = ", start)], namespace)  # noqa: S102 - our own docs
    return namespace["tools"]


def test_the_docs_examples_are_the_ones_tested_here():
    """The Receipt and the forced tool call that docs/serving.md shows are the ones whose bounds are checked below."""
    code = _docs_python_block("class Receipt(BaseModel)")
    namespace: dict = {}
    exec(code[:code.index("\nresp = ")], namespace)  # noqa: S102 - our own docs
    assert namespace["Receipt"].model_json_schema() == Receipt.model_json_schema()
    assert "response_format=Receipt, max_tokens=200" in code and '"Read this receipt."' in code
    assert "can never exceed 175 tokens, so `max_tokens=200` always fits it" in SERVING_DOC.read_text()
    code = _docs_python_block('tool_choice="required"')
    assert "max_tokens=200" in code and "parallel_tool_calls=False" in code
    assert "195 bytes, hence at most 195 tokens, so `max_tokens=200` always fits it" in SERVING_DOC.read_text()
    assert _docs_tools()[0]["function"]["parameters"]["properties"]["city"]["maxLength"] == 20


def _matcher_check(demo_model):
    """`admitted(spec)(text)`: whether the grammar of `spec` admits `text` whole, fed byte by byte (the most
    tokens it can take), on the demo tokenizer, each of whose tokens is at least a byte."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from vlserve.engine.structured.grammar import grammar_for

    tok = AutoTokenizer.from_pretrained(demo_model)
    llt = llguidance.hf.from_tokenizer(tok, eos_token=tok.eos_token_id)
    assert min(len(llt.decode_bytes([t])) for t in range(llt.vocab_size) if not llt.is_special_token(t)) >= 1

    def admitted(spec):
        grammar = grammar_for(spec)

        def check(text: str) -> bool:
            m = llguidance.LLMatcher(llt, grammar)
            ids = [t for b in text.encode() for t in llt.tokenize_bytes(bytes([b]))]
            return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_stopped()
        return check
    return admitted


def test_the_docs_receipt_fits_its_max_tokens_at_worst(demo_model):
    """Every answer the schema admits is at most 175 bytes, hence at most 175 tokens (each token of the demo
    tokenizer is at least a byte; special tokens never match JSON text). A string character costs at most 6
    bytes, the \\u001f escape (4-byte UTF-8 characters are less; general \\u escapes are refused)."""
    from openai.lib._pydantic import to_strict_json_schema

    from vlserve.server.protocol import _response_format

    admitted = _matcher_check(demo_model)(_response_format({"type": "json_schema", "json_schema": {
        "name": "Receipt", "schema": to_strict_json_schema(Receipt), "strict": True}}))

    def receipt(shop: str, cents: str = "10000000") -> str:
        return '{"shop":"' + shop + '","total_cents":' + cents + ',"paid_by_card":false}'

    worst = receipt("\\u001f" * 20)
    assert admitted(worst) and len(worst.encode()) == 175  # max_tokens=200 leaves room
    assert admitted(receipt("\U0001f600" * 20)) and len(receipt("\U0001f600" * 20).encode()) < 175
    for too_much in (receipt("\\u001f" * 21), receipt("a", "10000001"), receipt("a", "-1"), receipt("\\ud83d\\ude00"),
                     receipt("\\u00e9")):
        assert not admitted(too_much), too_much


def test_the_docs_forced_tool_call_fits_its_max_tokens_at_worst(demo_model):
    """docs/serving.md's call (tool_choice "required", parallel_tool_calls false, a city of at most 20 characters)
    is at most 195 bytes in the layout the grammar fixes, hence at most 195 tokens: max_tokens=200 fits it."""
    from vlserve.frontend.tool_calls import call_grammar, check_tool_choice, check_tools

    tools = check_tools(_docs_tools())
    admitted = _matcher_check(demo_model)(call_grammar(tools, check_tool_choice("required", tools), parallel=False))

    def call(city: str) -> str:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'

    worst = call("\\u001f" * 20)
    assert admitted(worst) and len(worst.encode()) == 195
    assert admitted(call("Paris"))
    for too_much in (call("\\u001f" * 21), call("Paris") + "\n" + call("Rome"),
                     call("Paris").replace('"}}', '", "country": "FR"}}')):
        assert not admitted(too_much), too_much


def test_the_docs_parse_example_works_with_the_demo_model(demo_model):
    """`client.chat.completions.parse(...)` as docs/serving.md writes it, sampled with 16 seeds: always parsed."""
    with RemoteServer(demo_model) as server:
        client = server.client(timeout=120)
        image_url = data_url(demo_image())

        def example(seed: int):
            resp = client.chat.completions.parse(
                model=demo_model, response_format=Receipt, max_tokens=200, temperature=1.0, seed=seed,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                       {"type": "text", "text": "Read this receipt."}]}])
            return resp.choices[0]

        with ThreadPoolExecutor(8) as pool:
            choices = list(pool.map(example, range(16)))
    assert all(isinstance(c.message.parsed, Receipt) and c.finish_reason == "stop" for c in choices)
    assert len({c.message.parsed.shop for c in choices}) > 8  # sampled, not one answer 16 times
