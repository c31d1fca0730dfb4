"""A bound on the values a chat template may build: `'x' * 10**9` is refused before it is computed.

transformers renders chat templates in Jinja's ImmutableSandboxedEnvironment, which stops code execution and
limits `range()`, but lets `*` and `+` build strings and lists of any size: one line of a request's template
(`--trust-request-chat-template`) could take gigabytes. The sandbox below intercepts those two operators and
`~` and refuses a result longer than MAX_TEMPLATE_VALUE_LEN (a prompt that long could never fit a model's context).
It replaces the class transformers compiles templates with, once, at import.
"""

from __future__ import annotations

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_VALUE_LEN = 8 * 2**20  # characters (or items) of one string or list a template computes


_PADDING = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _BoundedConcat(CodeGenerator):
    """`a ~ b` (string concatenation) goes through the environment's bounded join too."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+"})
    code_generator_class = _BoundedConcat

    def call(self, __context, __obj, *args, **kwargs):
        # str.center/ljust/rjust/zfill/expandtabs pad to a width the template picks.
        if getattr(__obj, "__self__", None).__class__ is str and getattr(__obj, "__name__", "") in _PADDING:
            width = next((a for a in (*args, *kwargs.values()) if isinstance(a, int)), 0)
            if width * (8 if __obj.__name__ == "expandtabs" else 1) > MAX_TEMPLATE_VALUE_LEN:
                raise SecurityError(f"the template pads a string to {width}, more than the "
                                    f"{MAX_TEMPLATE_VALUE_LEN} characters allowed")
        return super().call(__context, __obj, *args, **kwargs)

    def bounded_join(self, parts) -> str:
        texts = [str(p) for p in parts]
        total = sum(map(len, texts))
        if total > MAX_TEMPLATE_VALUE_LEN:
            raise SecurityError(f"the template joins strings into {total} characters, more than the "
                                f"{MAX_TEMPLATE_VALUE_LEN} allowed")
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                n = _size(seq)
                if n is not None and isinstance(times, int) and n * times > MAX_TEMPLATE_VALUE_LEN:
                    raise SecurityError(f"the template repeats a value of {n} to {n * times} characters or "
                                        f"items, more than the {MAX_TEMPLATE_VALUE_LEN} allowed")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_TEMPLATE_VALUE_LEN:
                raise SecurityError(f"the template joins values into {a + b} characters or items, more than the "
                                    f"{MAX_TEMPLATE_VALUE_LEN} allowed")
        return super().call_binop(context, operator, left, right)


def install() -> None:
    """Makes transformers compile chat templates in BoundedSandbox (idempotent)."""
    from transformers.utils import chat_template_utils

    if getattr(chat_template_utils, "ImmutableSandboxedEnvironment", None) is not BoundedSandbox:
        chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox
        chat_template_utils._compile_jinja_template.cache_clear()
