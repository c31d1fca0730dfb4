"""Chat templates cannot build huge values: `*`, `+`, `~` and padding are bounded before they compute."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vlserve.core.errors import InvalidInputError
from vlserve.frontend.template_sandbox import MAX_TEMPLATE_VALUE_LEN
from vlserve.frontend.tokenizer import render_chat

MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(30) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s }}"


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt("qwen2_vl")))


@pytest.mark.parametrize("template", [
    "{{ 'x' * 1000000000 }}", "{{ 1000000000 * 'x' }}", "{{ ['a'] * 100000000 }}",
    DOUBLING.replace("OP", "+"), DOUBLING.replace("OP", "~"), "{{ 'x'.center(1000000000) }}",
    "{{ 'x'.zfill(1000000000) }}",
])
def test_a_template_that_would_build_gigabytes_is_refused(tokenizer, template):
    with pytest.raises(InvalidInputError, match="SecurityError: the template .* allowed"):
        render_chat(tokenizer, MESSAGES, chat_template=template)


def test_ordinary_templates_are_untouched(tokenizer):
    template = "{{ 'ab' * 3 }}|{{ 'a' ~ 1 ~ 'b' }}|{{ 2 + 3 }}|{{ [1] + [2] }}|{{ 'x'.ljust(3) }}."
    assert render_chat(tokenizer, MESSAGES, chat_template=template) == "ababab|a1b|5|[1, 2]|x  ."
    within = render_chat(tokenizer, MESSAGES, chat_template="{{ 'x' * %d }}" % MAX_TEMPLATE_VALUE_LEN)
    assert len(within) == MAX_TEMPLATE_VALUE_LEN
    assert render_chat(tokenizer, MESSAGES).endswith("<|im_start|>assistant\n")  # the checkpoint's own
