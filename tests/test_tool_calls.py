"""Tool calling pieces without a server: parsing whole and streamed answers, the call grammar, the hermes
prompt for templates without tools, and the checks on `tools` / `tool_choice` / tool turns."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from vlserve.core.errors import InvalidInputError
from vlserve.engine.structured.grammar import grammar_for
from vlserve.frontend.chat import parse_chat_messages
from vlserve.frontend.tokenizer import render_chat
from vlserve.frontend.tool_calls import (
    ToolCallStream,
    ToolChoice,
    call_grammar,
    check_tool_choice,
    check_tools,
    extract_tool_calls,
)
from vlserve.frontend.tool_prompt import hermes_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 99},
                       "b": {"type": "integer", "minimum": -9, "maximum": 99}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_extract_whole_answer():
    content, calls = extract_tool_calls(ANSWER)
    assert content == "Let me look."
    assert _calls(calls) == [("get_weather", {"city": "Oslo", "days": 2}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", ["plain answer", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\n{\"x\": 1}",
                                  '<tool_call>\n["name"]\n</tool_call>'])
def test_text_that_is_no_call_stays_content(text):
    assert extract_tool_calls(text) == (text, [])


def test_stream_gives_the_same_calls_at_every_split():
    want_content, want_calls = extract_tool_calls(ANSWER)
    for step in (1, 2, 3, 7, 50):
        stream, content, calls = ToolCallStream(), [], []
        for end in range(step, len(ANSWER) + step, step):
            text = ANSWER[:end]
            new_content, new_calls = stream.feed(text, finished=end >= len(ANSWER))
            content.append(new_content)
            calls += new_calls
        assert "".join(content) == want_content
        assert "<" not in "".join(content)  # the tags never leak into content
        assert [c["index"] for c in calls] == [0, 1]
        assert _calls(calls) == _calls(want_calls)


def test_a_closing_tag_inside_an_argument_does_not_cut_the_call():
    text = '<tool_call>\n{"name": "echo", "arguments": {"s": "a</tool_call>b"}}\n</tool_call>'
    content, calls = extract_tool_calls(text)
    assert content is None and _calls(calls) == [("echo", {"s": "a</tool_call>b"})]
    stream, got = ToolCallStream(), []
    for end in range(1, len(text) + 1):
        got += stream.feed(text[:end], end == len(text))[1]
    assert _calls(got) == _calls(calls)


def test_deeply_nested_output_is_text_not_a_crash():
    text = "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"
    assert extract_tool_calls(text) == (text, [])


def test_stream_without_calls_is_plain_text_and_a_cut_call_is_text():
    stream = ToolCallStream()
    assert stream.feed("Hi <tool", False) == ("Hi", [])  # may be a tag, and the space may precede a call
    assert stream.feed("Hi <tooling>", True) == (" <tooling>", [])
    stream = ToolCallStream()
    assert stream.feed('<tool_call>\n{"name": "a"', False) == ("", [])
    assert stream.feed('<tool_call>\n{"name": "a"', True) == ('<tool_call>\n{"name": "a"', [])


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt("qwen2_vl")))


def _matcher(tokenizer, spec):
    llt = llguidance.hf.from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id)
    return llguidance.LLMatcher(llt, grammar_for(spec))


@pytest.mark.parametrize("text, ok", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "add", "arguments": {"a": -4, "b": 10}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
    ('Sure! <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', False),
])
def test_required_grammar_admits_exactly_valid_calls(tokenizer, text, ok):
    m = _matcher(tokenizer, call_grammar(TOOLS, ToolChoice("required"), parallel=True))
    tokens = tokenizer.encode(text)
    accepted = m.validate_tokens(tokens) == len(tokens)
    if accepted:
        m.consume_tokens(tokens)
    assert (accepted and m.is_accepting()) == ok


def test_tools_with_definitions_as_pydantic_writes_them(tokenizer):
    pydantic = __import__("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    class Route(pydantic.BaseModel):
        start: Point
        end: Point

    tool = {"type": "function", "function": {"name": "route", "parameters": Route.model_json_schema()}}
    assert "$defs" in tool["function"]["parameters"]
    m = _matcher(tokenizer, call_grammar([tool, ADD], ToolChoice("required"), parallel=False))
    text = ('<tool_call>\n{"name": "route", "arguments": {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}}}'
            '\n</tool_call>')
    assert m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()


def test_named_and_single_call_grammars(tokenizer):
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    for choice, parallel in ((ToolChoice("named", "add"), True), (ToolChoice("required"), False)):
        m = _matcher(tokenizer, call_grammar(TOOLS, choice, parallel))
        assert m.validate_tokens(tokenizer.encode(two)) < len(tokenizer.encode(two))
    named = _matcher(tokenizer, call_grammar(TOOLS, ToolChoice("named", "add"), True))
    weather = tokenizer.encode(ANSWER.split("\n", 1)[1].split("\n<tool_call>")[0])
    assert named.validate_tokens(weather) < len(weather)
    assert call_grammar(TOOLS, ToolChoice("auto"), True) is None


def test_hermes_prompt_for_a_template_without_tools(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "text", "text": "radar:"}, {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    ]
    chat = parse_chat_messages(messages)
    assert chat.media["image"] == ["data:x"]  # a picture inside a tool result is a picture like any other
    text = render_chat(tokenizer, chat.messages, tools=TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    assert ("<|im_start|>user\n<tool_response>\nradar:<|vision_start|><|image_pad|><|vision_end|>\n</tool_response>\n"
            "<tool_response>\nsunny\n</tool_response><|im_end|>") in text
    assert text.count("<|im_start|>system") == 1 and "You are a helpful assistant." in text


def test_a_template_with_tools_gets_them_itself(tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}"
                "{{ c.function.arguments.city }}{% endfor %}{% endfor %}")
    chat = parse_chat_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}])
    assert render_chat(tokenizer, chat.messages, False, template, tools=TOOLS) == "[get_weather][add]<assistant>Oslo"


def test_hermes_keeps_an_existing_system_message():
    out = hermes_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [ADD])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("tools, choice, message", [
    ("x", None, "must be a list"),
    ([{"type": "function"}], None, "must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "name"),
    ([ADD, ADD], None, "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters"),
    ([ADD], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([ADD], "sometimes", "tool_choice must be"),
    ([ADD], {"type": "function", "function": {"name": ["add"]}}, "not among the tools"),
    ([], "required", "needs tools"),
])
def test_bad_tools_and_choices(tools, choice, message):
    with pytest.raises(InvalidInputError, match=message):
        check_tool_choice(choice, check_tools(tools))


@pytest.mark.parametrize("message", [
    {"role": "assistant", "tool_calls": "x"},
    {"role": "user", "tool_calls": []},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
    {"role": "tool", "tool_call_id": 3, "content": "x"},
])
def test_bad_tool_turns(message):
    with pytest.raises(InvalidInputError):
        parse_chat_messages([message])


def _stream_calls(text: str, step: int) -> tuple[str, list[dict]]:
    stream, content, calls = ToolCallStream(), [], []
    for end in range(step, len(text) + step, step):
        new_content, new_calls = stream.feed(text[:end], finished=end >= len(text))
        content.append(new_content)
        calls += new_calls
    return "".join(content), calls


def _one_call(name: str, arguments_text: str, key: str = "arguments", first: bool = False) -> str:
    members = [f'"name": "{name}"', f'"{key}": {arguments_text}']
    return "<tool_call>\n{" + ", ".join(members[::-1] if first else members) + "}\n</tool_call>"


@pytest.mark.parametrize("arguments", [
    '{"x": 0.1000000000000000055, "big": 123456789012345678901234567890, "e": 1E+400, "neg": -0.0, "f": 2.50}',
    '{"n": ' + "9" * 5000 + "}",  # more digits than Python's int() takes
    '{ "a" :[1 ,2,\t{"b" : {"c": [ ]}}] ,"d":{} }',  # the model's own spacing
    '{"s": "}{ ][ \\" \\\\\\" , : \\u0041 \\/ </tool_call> {\\"k\\": 1}"}',  # braces, quotes, escapes in a string
    '{"city": "Zürich", "emoji": "😀", "escaped": "\\u00e9\\ud83d\\ude00", "rtl": "שלום"}',
    '{"deep": [[[[{"a": [{"b": [[["x"]]]}]}]]]], "t": true, "f": false, "n": null}',
    "{}",
    "[1, 2]",  # not an object, passed on as written (as vLLM does)
])
def test_arguments_are_the_models_own_text(arguments):
    """The "arguments" reach the client exactly as written (numbers not rounded, spacing and escapes kept), in
    the whole answer and at every split of a stream, whatever the key order."""
    for first in (False, True):
        text = "Sure. " + _one_call("f", arguments, first=first) + " done"
        content, calls = extract_tool_calls(text)
        assert content == "Sure.done"  # whitespace next to a call is not content
        assert [c["function"]["arguments"] for c in calls] == [arguments]
        assert calls[0]["function"]["name"] == "f"
        for step in (1, 5, 64):
            streamed_content, streamed = _stream_calls(text, step)
            assert streamed_content == "Sure.done"
            assert [c["function"]["arguments"] for c in streamed] == [arguments]


def test_arguments_variants():
    """"parameters" (some models write it) like "arguments"; none given: "{}"; a repeated key: its last value,
    as JSON readers take it; arguments written as a JSON string: that string, which must hold JSON."""
    assert extract_tool_calls(_one_call("f", '{"a": 1.10}', key="parameters"))[1][0]["function"]["arguments"] == \
        '{"a": 1.10}'
    assert extract_tool_calls('<tool_call>{"name": "f"}</tool_call>')[1][0]["function"]["arguments"] == "{}"
    twice = '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"a":  2.0}}</tool_call>'
    assert extract_tool_calls(twice)[1][0]["function"]["arguments"] == '{"a":  2.0}'
    quoted = _one_call("f", json.dumps('{"a": 0.1000000000000000055}'))
    assert extract_tool_calls(quoted)[1][0]["function"]["arguments"] == '{"a": 0.1000000000000000055}'


@pytest.mark.parametrize("arguments", [
    '{"x": NaN}', '{"x": Infinity}', '{"x": [1, -Infinity]}', '{"a": {"b": NaN}}',
    '"{\\"x\\": NaN}"',  # a string whose content is not strict JSON
    '"Oslo"',
])
def test_arguments_that_are_not_strict_json_are_no_call(arguments):
    """vLLM's hermes parser leaves an answer it cannot parse as content; here the block that is no strict JSON
    stays content (the other calls are still calls), the same whole and streamed."""
    good = _one_call("add", '{"a": 1, "b": 2}')
    bad = _one_call("f", arguments)
    text = f"{good}\n{bad}"
    content, calls = extract_tool_calls(text)
    assert content == bad
    assert _calls(calls) == [("add", {"a": 1, "b": 2})]
    for step in (1, 3, 50):
        streamed_content, streamed = _stream_calls(text, step)
        assert streamed_content == bad
        assert _calls(streamed) == [("add", {"a": 1, "b": 2})]
    assert extract_tool_calls(bad) == (bad, [])
