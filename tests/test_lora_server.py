"""LoRA adapters through `vlserve serve` and the official openai client: a request picks an adapter by its model
name and gets the offline engine's answer with that adapter (greedy, fp32), not the base model's; /v1/models lists
the adapters under the base model; vLLM's runtime endpoints load and unload adapters (only with
--allow-runtime-lora); a bad adapter is a 400 naming the problem, an unknown name a 404, and the server serves on."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import types

import httpx
import openai
import pytest

from tests.conftest import noise_image
from tests.lora_utils import make_peft_adapter
from tests.server_utils import HTTP, RemoteServer
from tests.test_server_api import data_url, image_part, user
from vlserve import LLM, LoRARequest, SamplingParams
from vlserve.core.config import ServerArgs
from vlserve.core.errors import EXIT_CONFIG, InvalidInputError
from vlserve.frontend.chat import parse_chat_messages
from vlserve.frontend.tokenizer import render_chat
from vlserve.server.serving import OpenAIServingLoRA

BASE = "tiny"
MAX_MODEL_LEN = 1024
MAX_RANK = 8
N_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    """name -> folder: served from the start ("lm": the language model; "both": it and the vision tower), loaded
    at runtime ("late"), and refused (rank over --max-lora-rank, a config nested too deeply, a folder outside
    --lora-dir, the folder of the others, and a symlink there leading out)."""
    root, elsewhere = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("elsewhere")
    made = {"lm": make_peft_adapter(ckpt, root / "lm", "lm", seed=1),
            "both": make_peft_adapter(ckpt, root / "both", "both", seed=2),
            "late": make_peft_adapter(ckpt, root / "late", "lm", seed=3),
            "too-big": make_peft_adapter(ckpt, root / "too-big", "lm", rank=2 * MAX_RANK),
            "deep": make_peft_adapter(ckpt, root / "deep", "lm", seed=4),
            "outside": make_peft_adapter(ckpt, elsewhere / "outside", "lm", seed=5),
            "escape": root / "escape"}
    (root / "escape").symlink_to(made["outside"])
    (made["deep"] / "adapter_config.json").write_text('{"r": ' + "[" * 200_000 + "]" * 200_000 + "}")
    return made


@pytest.fixture(scope="module")
def server(ckpt, adapters):
    with RemoteServer(ckpt, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
                      BASE, "--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2",
                      "--lora-modules", f"lm={adapters['lm']}", f"both={adapters['both']}",
                      "--allow-runtime-lora", "--lora-dir", str(adapters["lm"].parent)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


@pytest.fixture(scope="module")
def offline(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True, max_lora_rank=MAX_RANK,
              max_loras=2)
    yield llm
    llm.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)


def greedy(model: str) -> dict:
    return {"model": model, "max_tokens": N_TOKENS, "temperature": 0, "extra_body": {"min_tokens": N_TOKENS}}


def offline_answer(offline, adapters, prompt, name: str | None, params: SamplingParams = GREEDY) -> str:
    lora = None if name is None else LoRARequest(name, 1 + sorted(adapters).index(name), str(adapters[name]))
    return offline.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def chat_prompt(offline, messages) -> dict:
    """The prompt the server renders for `messages` (LLM.chat's steps: it takes no lora_request)."""
    chat = parse_chat_messages(messages, modalities=offline.engine.cfg.model.modalities)
    return chat.prompt(render_chat(offline.tokenizer, chat.messages, True, None))


def post(server, path: str, body: dict) -> httpx.Response:
    return server.post(path, json=body)


# ---- choosing an adapter by model name ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lm", "both"])
def test_chat_with_a_picture_by_adapter_name_matches_offline(client, offline, adapters, name):
    messages = user(image_part(data_url(noise_image(64, 48, 1))), "What is in this picture?")
    resp = client.chat.completions.create(messages=messages, **greedy(name))
    prompt = chat_prompt(offline, messages)
    assert resp.model == name
    assert resp.choices[0].message.content == offline_answer(offline, adapters, prompt, name)
    assert resp.choices[0].message.content != offline_answer(offline, adapters, prompt, None)
    base = client.chat.completions.create(messages=messages, **greedy(BASE))
    assert base.model == BASE and base.choices[0].message.content == offline_answer(offline, adapters, prompt, None)


def test_completions_and_streams_by_adapter_name(client, offline, adapters):
    prompt = "The capital of France is"
    resp = client.completions.create(prompt=prompt, **greedy("lm"))
    assert resp.model == "lm" and resp.choices[0].text == offline_answer(offline, adapters, prompt, "lm")
    assert resp.choices[0].text != offline_answer(offline, adapters, prompt, None)
    chunks = list(client.completions.create(prompt=prompt, stream=True, **greedy("lm")))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert {c.model for c in chunks} == {"lm"}
    messages = user("Tell me a story.")
    full = client.chat.completions.create(messages=messages, **greedy("lm"))
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **greedy("lm")))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert {c.model for c in chunks} == {"lm"}


def test_responses_take_an_adapter_name(client):
    answer = client.responses.create(model="both", input="Hello there", max_output_tokens=N_TOKENS, temperature=0)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hello there"}], model="both",
                                          max_tokens=N_TOKENS, temperature=0)
    assert answer.output_text == chat.choices[0].message.content


def test_unknown_model_is_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(prompt="hi", **greedy("nope"))
    message = e.value.response.json()["error"]["message"]
    assert "'nope'" in message and "'tiny'" in message and "'lm'" in message and "'both'" in message


def test_models_lists_the_base_model_and_its_adapters(server, adapters):
    cards = {c["id"]: c for c in HTTP.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards[BASE]["parent"] is None
    for name in ("lm", "both"):
        lora = cards[name].pop("lora")  # what a router needs to hash prompts as this server does
        assert cards[name] == {"id": name, "object": "model", "created": 0, "owned_by": "vlserve",
                               "root": str(adapters[name]), "parent": BASE, "max_model_len": MAX_MODEL_LEN}
        assert lora["key"].startswith(f"{name}@") and lora["towers"] is (name == "both")


# ---- runtime loading ----------------------------------------------------------------------------------------
def test_runtime_load_use_unload(server, client, offline, adapters):
    prompt = "Once upon a time"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert "late" in {c["id"] for c in HTTP.get(server.url + "/v1/models", timeout=10).json()["data"]}
    text = client.completions.create(prompt=prompt, **greedy("late")).choices[0].text
    assert text == offline_answer(offline, adapters, prompt, "late")
    assert text != client.completions.create(prompt=prompt, **greedy("lm")).choices[0].text
    # load_inplace (vLLM's): the name now serves another adapter
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["lm"]),
                                               "load_inplace": True})
    assert r.status_code == 200
    assert client.completions.create(prompt=prompt, **greedy("late")).choices[0].text == \
        offline_answer(offline, adapters, prompt, "lm")
    # a request running with it when it is unloaded finishes with it
    stream = iter(client.completions.create(prompt=prompt, stream=True, model="late", max_tokens=64, temperature=0,
                                            extra_body={"min_tokens": 64}))
    first = next(stream)
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and "'late'" in r.text
    chunks = [first, *stream]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    long = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        offline_answer(offline, adapters, prompt, "lm", long)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(prompt=prompt, **greedy("late"))
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 404 and "'late' is not loaded" in r.json()["error"]["message"]
    assert "late" not in {c["id"] for c in HTTP.get(server.url + "/v1/models", timeout=10).json()["data"]}


REFUSED_PATH = "is not an adapter folder this server may load (a folder under its --lora-dir"


@pytest.mark.parametrize("body,expected", [
    ({"lora_name": "big", "lora_path": "{too-big}"}, "over max_lora_rank 8"),
    ({"lora_name": "deep", "lora_path": "{deep}"}, "nests too deeply"),
    ({"lora_name": "gone", "lora_path": "/no/such/adapter"}, REFUSED_PATH),
    ({"lora_name": "gone", "lora_path": "{lm}/adapter_config.json"}, REFUSED_PATH),
    ({"lora_name": "gone", "lora_path": "{outside}"}, REFUSED_PATH),
    ({"lora_name": "gone", "lora_path": "{escape}"}, REFUSED_PATH),
    ({"lora_name": BASE, "lora_path": "{lm}"}, "served model's name"),
    ({"lora_name": "x" * 257, "lora_path": "{lm}"}, "lora_name"),
    ({"lora_name": "x", "lora_path": "{lm}", "extra": 1}, "extra"),
    ({"lora_name": "x"}, "lora_path"),
])
def test_a_bad_load_is_400_and_the_server_serves_on(server, client, adapters, body, expected):
    body = {k: v.format(**{k: str(p) for k, p in adapters.items()}) if isinstance(v, str) else v
            for k, v in body.items()}
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]
    if expected == REFUSED_PATH:  # one answer, whatever the cause: nothing is learnt about the server's files
        assert r.json()["error"]["message"] == (f"LoRA adapter 'gone': {body['lora_path']!r} {REFUSED_PATH} "
                                                "holding adapter_config.json and adapter_model.safetensors)")
    assert {c["id"] for c in HTTP.get(server.url + "/v1/models", timeout=10).json()["data"]} == {BASE, "lm", "both"}
    assert client.completions.create(prompt="hi", **greedy("lm")).choices[0].text


@pytest.mark.parametrize("enable_lora,message", [(True, "--allow-runtime-lora"), (False, "--enable-lora")])
def test_runtime_endpoints_refuse_without_their_flags(enable_lora, message):
    """Refused before the body is read (the handler itself, no server: these flags are all it depends on)."""
    engine = types.SimpleNamespace(loras=object() if enable_lora else None)
    serving = OpenAIServingLoRA(engine, ServerArgs(allow_runtime_lora=False), BASE)
    for handler in (serving.load, serving.unload):
        with pytest.raises(InvalidInputError, match=message):
            asyncio.run(handler(None))


@pytest.mark.parametrize("command", ["serve", "decode"])
def test_runtime_loads_without_a_usable_lora_dir_stop_the_start(command, tmp_path, caplog):
    """--allow-runtime-lora without --lora-dir would refuse every load, and a --lora-dir that is no folder could
    serve none: exit 78 naming the flag, before anything loads."""
    from vlserve.cli import main

    (tmp_path / "file").write_text("")
    cases = [([], "--allow-runtime-lora needs --lora-dir"),
             (["--lora-dir", str(tmp_path / "missing")], f"--lora-dir {tmp_path / 'missing'}: no such folder"),
             (["--lora-dir", str(tmp_path), str(tmp_path / "file")], f"--lora-dir {tmp_path / 'file'}: not a folder")]
    for flags, words in cases:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            argv = [command, "--model", "/no/such/model", "--enable-lora", "--allow-runtime-lora", *flags]
            assert main(argv) == EXIT_CONFIG
        assert words in caplog.text, (flags, caplog.text)


@pytest.mark.parametrize("name,words", [("gone", "is not a folder"), ("deep", "nests too deeply")])
def test_a_bad_lora_module_stops_the_start(ckpt, adapters, tmp_path, name, words):
    path = adapters.get(name, tmp_path / "missing")
    out = subprocess.run([sys.executable, "-m", "vlserve", "serve", "--model", str(ckpt), "--port", "0",
                          "--enable-lora", "--lora-modules", f"{name}={path}"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == EXIT_CONFIG, out.stderr[-3000:]
    assert f"LoRA adapter {name!r}" in out.stderr and words in out.stderr, out.stderr[-3000:]

