"""A value of the wrong type in any field of any request body is a 400 that names the field, never a 500.

The table is made from the request models' own fields (a field added to a model is covered without a line here):
each field gets every value of `CANDIDATES` its declared type refuses, and the body runs the checks its HTTP handler
runs before the engine (parse, check_fields, the translation Responses makes into a chat request, sampling
parameters, tools, messages). The transcription form is walked the same way from its field tables, and run-batch
lines from the fields of OpenAI's batch line. The HTTP handlers' side is in test_responses.py,
test_transcriptions.py and test_run_batch.py."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

import vlserve.server
from tests.audio_samples import encode_audio, noise
from vlserve.core.config import ServerArgs
from vlserve.core.errors import VlserveError
from vlserve.frontend.chat import parse_chat_messages
from vlserve.media.audio import AudioLimits
from vlserve.server.batch_files import InputLines, LineError
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from vlserve.server.responses_protocol import PASSED_EXTRAS, ResponsesRequest
from vlserve.server.serving import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vlserve.server.serving_transcription import (
    _NUMBER_FIELDS,
    _TEXT_FIELDS,
    TRANSCRIBE,
    TranscriptionOptions,
    decoded_clip,
)

SERVER = ServerArgs()
# Values of every JSON type, each wrong for some declared type: a string where a number is wanted, a number where a
# string or a list is, an object, a list, null, a bool.
CANDIDATES: list[Any] = ["abc", "", 7, -1, 1.5, True, False, None, [], [1], ["a"], [[1]], {}, {"a": 1}]


def _chat_checks(body: ChatCompletionRequest, python_media: bool = False) -> None:
    """What OpenAIServingChat.start and _chat_text check before the engine."""
    body.check_fields(SERVER)
    top_k = body.logprobs_count()
    body.sampling_params(body.requested_max_tokens(), top_k)
    body.tool_setup()
    parse_chat_messages(body.messages, allow_python_objects=python_media)


def _responses_checks(body: ResponsesRequest) -> None:
    body.check_fields(SERVER)
    _chat_checks(body.to_chat_request())


def _completion_checks(body: CompletionRequest) -> None:
    body.check_fields(SERVER)
    body.prompts()
    body.sampling_params(body.max_tokens, body.logprobs)


# Every request model a handler parses: a valid body of it and the checks its handler runs.
REQUEST_MODELS = {
    ChatCompletionRequest: ({"messages": [{"role": "user", "content": "hi"}]}, _chat_checks),
    CompletionRequest: ({"prompt": "hi"}, _completion_checks),
    ResponsesRequest: ({"input": "hi"}, _responses_checks),
    LoadLoRAAdapterRequest: ({"lora_name": "a", "lora_path": "/a"}, lambda b: b.check_fields(SERVER)),
    UnloadLoRAAdapterRequest: ({"lora_name": "a"}, lambda b: b.check_fields(SERVER)),
}


def _declared(model: type[BaseModel]) -> dict:
    """A model's fields as bodies spell them; a Responses request's also the chat fields it passes on."""
    fields = dict(model.model_fields)
    if model is ResponsesRequest:
        fields.update({name: ChatCompletionRequest.model_fields[name] for name in PASSED_EXTRAS})
    return fields


def wrong_values(info) -> list:
    """The candidates the field's type (and its constraints) refuses."""
    annotation = Annotated.__class_getitem__((info.annotation, *info.metadata)) if info.metadata else info.annotation
    adapter = TypeAdapter(annotation, config=None if _model_in(info.annotation) else ConfigDict(strict=True))
    wrong = []
    for value in CANDIDATES:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            wrong.append(value)
    return wrong


def _model_in(annotation) -> type[BaseModel] | None:
    """The request model nested in a field's type (`StreamOptions | None`), if any."""
    for arg in (annotation, *getattr(annotation, "__args__", ())):
        if inspect.isclass(arg) and issubclass(arg, BaseModel):
            return arg
    return None


def _cases():
    for model, (valid, _) in REQUEST_MODELS.items():
        for name, info in _declared(model).items():
            for value in wrong_values(info):
                yield pytest.param(model, {**valid, name: value}, name, id=f"{model.__name__}.{name}={value!r}")
            nested = _model_in(info.annotation)
            for sub, sub_info in (nested.model_fields.items() if nested else ()):
                for value in wrong_values(sub_info):  # stream_options needs stream: true to be read at all
                    body = {**valid, "stream": True, name: {sub: value}}
                    yield pytest.param(model, body, f"{name}.{sub}", id=f"{model.__name__}.{name}.{sub}={value!r}")


def names_field(message: str, field: str) -> bool:
    """The message names `field` as a field (`seed: ...`, `stop.str: ...`, `'seed'`), not as part of a word."""
    return re.search(rf"(?<![\w.]){re.escape(field)}(?=[.:\[ ']|$)", message) is not None


def test_the_table_holds_every_request_model():
    """A request model added to the server (a model with check_fields, as OpenAIServing.parse needs) must be added
    to REQUEST_MODELS, so that its fields are walked too."""
    found = set()
    for mod in pkgutil.iter_modules(vlserve.server.__path__):
        module = importlib.import_module(f"vlserve.server.{mod.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and hasattr(cls, "check_fields") and not cls.__name__.startswith("_"):
                found.add(cls)
    assert found == set(REQUEST_MODELS)


@pytest.mark.parametrize("model, body, field", list(_cases()))
def test_a_wrongly_typed_field_is_a_400_naming_it(model, body, field):
    valid, checks = REQUEST_MODELS[model]
    with pytest.raises(VlserveError) as e:
        checks(parse_body(json.dumps(body).encode(), model))
    assert e.value.http_status == 400 and names_field(str(e.value), field), str(e.value)
    checks(parse_body(json.dumps(valid).encode(), model))  # the body without it is taken


def test_every_pass_through_field_of_a_response_is_checked_as_chat_checks_it():
    """The issue's cases: each of the fifteen fields Responses passes on, wrongly typed, was a 500."""
    for body, field in (({"input": "hi", "seed": "abc"}, "seed"), ({"input": "hi", "top_k": "many"}, "top_k"),
                        ({"input": "hi", "stop": 7}, "stop")):
        with pytest.raises(VlserveError, match=rf"invalid request: {field}") as e:
            _responses_checks(parse_body(json.dumps(body).encode(), ResponsesRequest))
        assert e.value.http_status == 400


# ---- the transcription form --------------------------------------------------------------------------------------
CLIP = encode_audio(noise(1600, seed=1), 16000)
# A form field's text that is no number, no integer (for an integer field), or no finite number.
NOT_NUMBERS = ["abc", "", " ", "true", "[1]", "{}", "nan", "inf", "-inf", "1e999", "0x10", "1_000", "1,5",
               "\u0661\u0662", "\uff11\uff12", "1.\u0665"]  # digits of other scripts: int() and float() take them
NOT_INTEGERS = ["1.5", "1e3", "99999999999999999999"]


def _form_checks(fields: dict[str, list[str]]) -> None:
    """What OpenAIServingTranscription.create checks before the engine."""
    opts = TranscriptionOptions.from_form(fields, TRANSCRIBE)
    _chat_checks(opts.chat_request(decoded_clip(CLIP, "wav", AudioLimits()).part), python_media=True)


def _form_cases():
    for name, kind in _NUMBER_FIELDS.items():
        for text in NOT_NUMBERS + (NOT_INTEGERS if kind is int else []):
            yield pytest.param({name: [text]}, name, id=f"{name}={text!r}")
        yield pytest.param({name: ["1", "2"]}, name, id=f"{name} twice")
    for name in _TEXT_FIELDS:
        yield pytest.param({name: ["en", "en"]}, name, id=f"{name} twice")


@pytest.mark.parametrize("fields, field", list(_form_cases()))
def test_a_wrongly_typed_form_field_is_a_400_naming_it(fields, field):
    with pytest.raises(VlserveError) as e:
        _form_checks(fields)
    assert e.value.http_status == 400 and names_field(str(e.value), field), str(e.value)


def test_the_form_without_them_is_taken():
    _form_checks({})
    _form_checks({name: ["1"] for name in _NUMBER_FIELDS} | {"response_format": ["srt"], "language": ["en"]})


# ---- run-batch lines ---------------------------------------------------------------------------------------------
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]}}
# What each field of a batch line may be; every other candidate is wrong for it.
LINE_FIELDS = {"custom_id": lambda v: isinstance(v, str) and v != "", "method": lambda v: v == "POST",
               "url": lambda v: v == "/v1/chat/completions", "body": lambda v: isinstance(v, dict)}


def test_every_field_of_a_batch_line_is_in_the_table():
    assert set(LINE_FIELDS) == set(LINE)


@pytest.mark.parametrize("field", list(LINE_FIELDS))
def test_a_wrongly_typed_batch_line_field_is_a_line_error_naming_it(field):
    for value in CANDIDATES:
        if LINE_FIELDS[field](value):
            continue
        item = InputLines(None, 1 << 20).check(json.dumps({**LINE, field: value}).encode())
        if field == "body" and value not in (None,) and not isinstance(item, LineError):
            # a body that is not an object goes to the endpoint as sent: its parse refuses it with a 400
            with pytest.raises(VlserveError, match="must be a JSON object") as e:
                parse_body(item.body, ChatCompletionRequest)
            assert e.value.http_status == 400
            continue
        assert isinstance(item, LineError) and item.param == field and names_field(item.message, field), item
