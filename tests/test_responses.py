"""POST /v1/responses through the official openai client (`client.responses.create` / `.stream`): every answer
equals the same request sent to /v1/chat/completions (text, pictures, instructions, structured outputs, tool
calls, a tool round trip), the stream's events come in the documented order and add up to the answer, and what
cannot be honoured is a clear 400 with the server unharmed."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.conftest import noise_image
from tests.server_utils import HTTP, RemoteServer
from tests.test_request_validation import names_field, wrong_values
from tests.test_server_api import data_url, image_part
from tests.test_tool_calls import TOOLS
from vlserve.core.errors import InvalidInputError
from vlserve.server.protocol import ChatCompletionRequest
from vlserve.server.responses_protocol import PASSED_EXTRAS, ResponsesRequest

MAX_TOKENS = 12
CHOICE_SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["left", "right"]}}, "required": ["pick"],
                 "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' flat spelling


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return str(tiny_ckpt("qwen2_vl"))


@pytest.fixture(scope="module")
def server(model):
    with RemoteServer(model, "--dtype", "float32", "--max-model-len", "2048", "--limit-mm-per-prompt",
                      "image=2") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


def _respond(client, model, **kw):
    kw.setdefault("temperature", 0)
    return client.responses.create(model=model, **kw)


def _chat(client, model, messages, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=messages, **kw)


def test_text_picture_and_instructions_answer_as_chat_does(client, model):
    picture = data_url(noise_image(56, 84, seed=3))
    answer = _respond(client, model, instructions="Describe briefly.", max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is here?"},
                                     {"type": "input_image", "image_url": picture, "detail": "auto"}]}])
    chat = _chat(client, model, max_tokens=MAX_TOKENS, messages=[
        {"role": "system", "content": "Describe briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is here?"}, image_part(picture)]}])
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert answer.usage.total_tokens == chat.usage.total_tokens
    finished = chat.choices[0].finish_reason
    assert (answer.status, finished) in (("incomplete", "length"), ("completed", "stop"))
    if answer.status == "incomplete":
        assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.id.startswith("resp") and answer.object == "response" and answer.store is False
    [item] = answer.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    # a plain string input is one user message
    plain = _respond(client, model, input="Hello there", max_output_tokens=MAX_TOKENS)
    assert plain.output_text == _chat(client, model, [{"role": "user", "content": "Hello there"}],
                                      max_tokens=MAX_TOKENS).choices[0].message.content


def test_stream_events_come_in_order_and_add_up_to_the_answer(client, model):
    whole = _respond(client, model, input="Tell me a story", max_output_tokens=MAX_TOKENS)
    with client.responses.stream(model=model, input="Tell me a story", max_output_tokens=MAX_TOKENS,
                                 temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas +
                     ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                      f"response.{whole.status}"])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress"


def test_structured_output_streamed_or_not(client, model):
    fmt = {"format": {"type": "json_schema", "name": "choice", "schema": CHOICE_SCHEMA, "strict": True}}
    answer = _respond(client, model, input="Which way?", text=fmt)
    assert answer.status == "completed"
    assert json.loads(answer.output_text)["pick"] in ("left", "right")
    chat = _chat(client, model, [{"role": "user", "content": "Which way?"}], response_format={
        "type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE_SCHEMA, "strict": True}})
    assert answer.output_text == chat.choices[0].message.content
    with client.responses.stream(model=model, input="Which way?", text=fmt, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == answer.output_text and final.status == "completed"
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}}
    with pytest.raises(openai.BadRequestError, match="text.format.schema cannot be compiled"):
        _respond(client, model, input="x", text=bad)


def test_forced_tool_call_as_a_function_call_item_streamed_or_not(client, model):
    choice = {"type": "function", "name": "get_weather"}
    answer = _respond(client, model, input="Weather?", tools=RESPONSES_TOOLS, tool_choice=choice, max_output_tokens=120)
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"get_weather"}
    chat = _chat(client, model, [{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=120,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chat_calls = chat.choices[0].message.tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in chat_calls]
    assert [c.call_id for c in calls] and all(c.call_id.startswith("call_") for c in calls)
    with client.responses.stream(model=model, input="Weather?", tools=RESPONSES_TOOLS, tool_choice=choice,
                                 max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    streamed = [(i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"]
    assert streamed == [(c.name, json.loads(c.arguments)) for c in calls]


def test_a_tool_round_trip_in_the_input_answers_as_chat_does(client, model):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Oslo", "days": 2})}
    answer = _respond(client, model, tools=RESPONSES_TOOLS, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": "Weather in Oslo?"}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    chat = _chat(client, model, tools=TOOLS, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    message = chat.choices[0].message
    texts = [i for i in answer.output if i.type == "message"]
    assert (texts[0].content[0].text if texts else None) == message.content


@pytest.mark.parametrize("extra, needle", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "https://x/y.pdf"}]}]},
     r"input\[0\].content\[0\]: input_file"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio",
                                              "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, "audio"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(noise_image(28, 28, s))}
                                             for s in range(3)]}]}, "at most 2"),
    ({"input": ""}, "input"),
])
def test_what_cannot_be_honoured_is_a_clear_400(server, extra, needle):
    r = HTTP.post(server.url + "/v1/responses", json={"input": "hi", **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert re.search(needle, r.json()["error"]["message"]), r.text


def test_wrongly_typed_passed_on_fields_are_400s_naming_them(server):
    """Each chat field a response passes on (seed, top_k, stop, ...), of a type chat refuses, was a 500 with a
    traceback in the log: the translated chat request was validated outside the handler's error path."""
    for name in PASSED_EXTRAS:
        value = wrong_values(ChatCompletionRequest.model_fields[name])[0]
        r = HTTP.post(server.url + "/v1/responses", json={"input": "hi", name: value}, timeout=60)
        assert r.status_code == 400 and names_field(r.json()["error"]["message"], name), (name, value, r.text)
    assert "Traceback" not in server.read_log()


def test_unknown_model_is_404_and_the_server_keeps_serving(server, client, model):
    r = HTTP.post(server.url + "/v1/responses", json={"model": "other", "input": "hi"}, timeout=60)
    assert r.status_code == 404
    assert _respond(client, model, input="still here", max_output_tokens=2).usage.output_tokens >= 1
    metrics = server.metrics()
    assert metrics["vlserve:prompt_tokens_total"] > 0


def test_the_chat_request_a_response_becomes():
    body = ResponsesRequest.model_validate({
        "input": [{"role": "developer", "content": "Be terse."},
                  {"role": "user", "content": [{"type": "input_audio",
                                                "input_audio": {"data": "AAA", "format": "wav"}}]},
                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]}],
        "instructions": "sys", "max_output_tokens": 5, "top_k": 3, "tool_choice": "none"})
    chat = body.to_chat_request()
    assert [m["role"] for m in chat.messages] == ["system", "developer", "user", "assistant", "tool"]
    assert chat.messages[2]["content"] == [{"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}}]
    assert [c["id"] for c in chat.messages[3]["tool_calls"]] == ["a", "b"]  # one turn's calls, one message
    assert chat.messages[4] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert chat.max_completion_tokens == 5 and chat.top_k == 3 and chat.tool_choice == "none"
    with pytest.raises(InvalidInputError, match=r"input\[0\].role"):
        ResponsesRequest.model_validate({"input": [{"role": "tool", "content": "x"}]}).to_chat_request()
