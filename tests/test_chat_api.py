"""`LLM.chat` with OpenAI-format messages must match `generate` on the equivalent templated prompt."""

from __future__ import annotations

import base64
import io

import pytest

from tests.conftest import assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_5_vl")), dtype="float32", num_kv_blocks=128)


@pytest.fixture(autouse=True)
def pool_is_full_after(llm):
    yield
    assert_pool_full(llm)


@pytest.fixture(scope="module")
def image():
    return noise_image(100, 70, 21)


@pytest.fixture(scope="module")
def png_file(image, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-images") / "picture.png"
    image.save(path)
    return path


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _templated(llm, messages):
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _image_messages(url_value):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": url_value},
                                         {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def image_reference(llm, image):
    """generate() on apply_chat_template(...) + the PIL image: what every image_url form must reproduce."""
    prompt = _templated(llm, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}])
    assert "<|image_pad|>" in prompt
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    return out


def test_string_content(llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)
    gen = llm.generate(_templated(llm, messages), GREEDY, use_tqdm=False)
    assert len(chat) == 1
    assert chat[0].prompt == _templated(llm, messages)
    assert chat[0].prompt_token_ids == gen[0].prompt_token_ids
    assert _tokens(chat) == _tokens(gen)


@pytest.mark.parametrize("form", ["data_url", "path", "file_url", "dict_data_url", "pil_part"])
def test_image_url_forms_match_generate(llm, image, png_file, image_reference, form):
    url_value = {
        "data_url": {"url": _data_url(image)},
        "path": {"url": str(png_file)},
        "file_url": {"url": f"file://{png_file}"},
        "dict_data_url": _data_url(image),  # a bare string instead of {"url": ...}
    }.get(form)
    if form == "pil_part":
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": QUESTION}]}]
    else:
        messages = _image_messages(url_value)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == image_reference.prompt_token_ids
    assert out.outputs[0].token_ids == image_reference.outputs[0].token_ids


def test_picture_matters(llm, image_reference):
    """Guards the test above: another picture gives another answer."""
    out = llm.chat(_image_messages({"url": _data_url(noise_image(100, 70, 22))}), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids != image_reference.outputs[0].token_ids


def test_batch_of_conversations(llm, image, png_file, image_reference):
    text_conv = [{"role": "user", "content": "Tell me a joke."}]
    multi_turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": [{"type": "text", "text": "Now compare "},
                                               {"type": "image_url", "image_url": {"url": str(png_file)}},
                                               {"type": "text", "text": " with "},
                                               {"type": "image_url", "image_url": {"url": _data_url(image)}}]}]
    convs = [text_conv, _image_messages({"url": str(png_file)}), multi_turn]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 3
    assert outs[1].outputs[0].token_ids == image_reference.outputs[0].token_ids
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (text_conv, multi_turn)]
    assert _tokens([outs[0], outs[2]]) == _tokens(alone)
    # the two-picture turn equals generate() with both images in order
    rendered = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "Now compare "}, {"type": "image"},
                                             {"type": "text", "text": " with "}, {"type": "image"}]}]
    gen = llm.generate({"prompt": _templated(llm, rendered), "multi_modal_data": {"image": [image, image]}},
                       GREEDY, use_tqdm=False)
    assert _tokens(gen) == [outs[2].outputs[0].token_ids]


def test_batch_with_per_conversation_params(llm):
    convs = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    outs = llm.chat(convs, [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert [len(t) for t in _tokens(outs)] == [3, 5]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x.wav"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}],
    [{"role": "user", "content": ["just a string part"]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
    [{"role": "wizard", "content": "hi"}],
    [{"content": "no role"}],
    [{"role": "user", "content": 42}],
])
def test_bad_messages(llm, messages):
    with pytest.raises(InvalidInputError):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_bad_image_in_chat(llm):
    with pytest.raises(InvalidInputError, match="not found"):
        llm.chat(_image_messages({"url": "/nonexistent/picture.png"}), GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError):
        llm.chat(_image_messages({"url": "data:image/png;base64,AAAA"}), GREEDY, use_tqdm=False)


def test_bad_conversation_in_batch_leaves_nothing_behind(llm):
    good = [{"role": "user", "content": "fine"}]
    bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x.mp4"}}]}]
    with pytest.raises(InvalidInputError):
        llm.chat([good, bad], GREEDY, use_tqdm=False)
    assert len(llm.chat([good], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_generate_accepts_prompt_token_ids(llm, image, image_reference):
    ids = llm.get_tokenizer().encode("Hello, how are you?")
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    by_text = llm.generate("Hello, how are you?", GREEDY, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_ids.prompt is None
    # token ids with the (unexpanded) image placeholder, plus the picture
    prompt = _templated(llm, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}])
    with_image = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(prompt),
                               "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
    assert with_image.prompt_token_ids == image_reference.prompt_token_ids
    assert with_image.outputs[0].token_ids == image_reference.outputs[0].token_ids


def test_chat_template_and_generation_prompt_options(llm):
    messages = [{"role": "user", "content": "Hello"}]
    no_gen = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert not no_gen.prompt.endswith("<|im_start|>assistant\n")
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=custom)[0]
    assert out.prompt == "[user] Hello\n"
