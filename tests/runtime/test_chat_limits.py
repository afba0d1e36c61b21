"""Chat templates are input: a hostile one is stopped with one line, in bounded time and memory."""

from __future__ import annotations

import time

import pytest

from llmopt.errors import OptionError
from llmopt.runtime.chat import apply_chat_template


class _Tok:
    bos_token = "<s>"
    eos_token = "</s>"

    def __init__(self, template: str):
        self.chat_template = template


@pytest.mark.parametrize("template,expect", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "a range of 100000 items"),
    ("{% for i in range(9000) %}{% for j in range(9000) %}{% for k in range(9000) %}{% endfor %}{% endfor %}{% endfor %}", "more than 2 s"),
    ("{{ 'a' * 10000000000 }}", "a repetition of 10000000000 items"),
    ("{{ ['a'] * 10000000 }}", "a repetition"),
    ("{% for i in range(9999) %}{{ 'x' * 999 }}{% endfor %}", "more than 1000000 characters"),
    ("{{ 10 ** 100000000 }}", "an exponent"),
    ("{{ raise_exception('no system role') }}", "failed: no system role"),
    ("{% for m in messages %}{{ m.content | nonexistent }}{% endfor %}", "failed"),
])  # fmt: skip
def test_hostile_templates_are_stopped(template, expect):
    start = time.monotonic()
    with pytest.raises(OptionError, match="chat template") as info:
        apply_chat_template(_Tok(template), "hi")
    assert expect in str(info.value)
    assert time.monotonic() - start < 5


def test_an_ordinary_template_renders():
    text = apply_chat_template(_Tok("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"), "hi", "be brief")
    assert text == "<|system|>be brief<|user|>hi<|assistant|>"
